//! Checks the worked example in docs/protocol.md byte for byte, so the document a device author
//! reads cannot drift from the code.

use std::collections::HashMap;

use confed_enclave::envelope::{self, Envelope};

fn example() -> HashMap<String, String> {
    let doc =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/protocol.md")).unwrap();
    let start = doc
        .find("```text worked-example")
        .expect("the worked example block is in docs/protocol.md");
    let block = &doc[start..];
    let block = &block[block.find('\n').unwrap() + 1..block[3..].find("```").unwrap() + 3];
    block
        .lines()
        .filter_map(|line| line.split_once(char::is_whitespace))
        .map(|(k, v)| (k.to_string(), v.trim().to_string()))
        .collect()
}

fn hex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn the_documented_envelope_opens_to_the_documented_update() {
    let ex = example();
    let private =
        confed_enclave::hpke::PrivateKey::from_bytes(&hex(&ex["recipient_private_key"])).unwrap();
    assert_eq!(
        private.public_key().unwrap().0.to_vec(),
        hex(&ex["recipient_public_key"])
    );
    let assignment_ref = envelope::assignment_ref(&ex["assignment_id"]);
    assert_eq!(assignment_ref, ex["assignment_ref"]);
    let round: u64 = ex["round"].parse().unwrap();
    assert_eq!(envelope::info(&ex["key_id"]), hex(&ex["info"]));
    assert_eq!(
        envelope::aad(&ex["task_id"], round, &assignment_ref),
        hex(&ex["aad"])
    );

    let sealed = Envelope::from_cbor(&hex(&ex["envelope"])).unwrap();
    assert_eq!(sealed.key_id, ex["key_id"]);
    assert_eq!(
        sealed.to_cbor(),
        hex(&ex["envelope"]),
        "canonical encoding as documented"
    );
    let update = envelope::open(&private, &sealed, &ex["task_id"], round, &assignment_ref).unwrap();
    assert_eq!(update.to_vec(), hex(&ex["update"]));

    let parsed = safetensors::SafeTensors::deserialize(&update).unwrap();
    let bias = parsed.tensor("dense.bias").unwrap();
    assert_eq!(bias.shape(), [2]);
    assert_eq!(
        bias.data(),
        [0.5f32.to_le_bytes(), (-0.25f32).to_le_bytes()].concat()
    );
}
