//! Checks the worked example in docs/protocol.md byte for byte, so the document a device author
//! reads cannot drift from the code.
//!
//! Not run again on PostgreSQL and GCS (.ci/run): it checks docs/protocol.md's bytes and reads no
//! store.

use std::collections::HashMap;

use confed_enclave::envelope::{self, Envelope};

/// The text of the fenced block whose info string is `text <name>` in docs/protocol.md.
fn block(name: &str) -> String {
    let doc =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/protocol.md")).unwrap();
    let fence = format!("```text {name}\n");
    let start = doc
        .find(&fence)
        .unwrap_or_else(|| panic!("the block `{name}` is in docs/protocol.md"))
        + fence.len();
    let end = start + doc[start..].find("```").unwrap();
    doc[start..end].to_string()
}

fn example() -> HashMap<String, String> {
    block("worked-example")
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
        confed_protocol::hpke::PrivateKey::from_bytes(&hex(&ex["recipient_private_key"])).unwrap();
    assert_eq!(
        private.public_key().unwrap().0.to_vec(),
        hex(&ex["recipient_public_key"])
    );
    let assignment_ref = envelope::assignment_ref(&ex["assignment_id"]);
    assert_eq!(assignment_ref, ex["assignment_ref"]);
    let round: u64 = ex["round"].parse().unwrap();
    assert_eq!(envelope::info(&ex["key_id"]), hex(&ex["info"]));

    // The policy block is the exact text (its last line ends with a line break).
    let policy_text = block("worked-example-policy");
    let policy = confed_protocol::policy::TaskPolicy::parse(&policy_text).unwrap();
    assert_eq!(policy.task_id, ex["task_id"]);
    assert_eq!(policy.encode(), policy_text, "canonical as documented");
    assert_eq!(
        confed_protocol::policy::sha256_hex(policy_text.as_bytes()),
        ex["policy_sha256"]
    );
    assert_eq!(
        confed_protocol::policy::sha256_hex(&hex(&ex["model"])),
        ex["model_sha256"]
    );
    let context = envelope::RoundContext {
        task_id: ex["task_id"].clone(),
        round,
        policy_sha256: ex["policy_sha256"].clone(),
        model_sha256: ex["model_sha256"].clone(),
    };
    assert_eq!(envelope::aad(&context, &assignment_ref), hex(&ex["aad"]));

    let sealed = Envelope::from_cbor(&hex(&ex["envelope"])).unwrap();
    assert_eq!(sealed.key_id, ex["key_id"]);
    assert_eq!(
        sealed.to_cbor(),
        hex(&ex["envelope"]),
        "canonical encoding as documented"
    );
    let update = envelope::open(&private, &sealed, &context, &assignment_ref).unwrap();
    assert_eq!(update.to_vec(), hex(&ex["update"]));

    let parsed = safetensors::SafeTensors::deserialize(&update).unwrap();
    let bias = parsed.tensor("dense.bias").unwrap();
    assert_eq!(bias.shape(), [2]);
    assert_eq!(
        bias.data(),
        [0.5f32.to_le_bytes(), (-0.25f32).to_le_bytes()].concat()
    );
}

/// Prints a fresh worked example (run with `--ignored --nocapture` after a format change, and
/// paste its output into docs/protocol.md; the test above then checks it).
#[test]
#[ignore = "a generator for docs/protocol.md, not a check"]
fn print_a_fresh_worked_example() {
    let ex = example();
    let private =
        confed_protocol::hpke::PrivateKey::from_bytes(&hex(&ex["recipient_private_key"])).unwrap();
    let public = private.public_key().unwrap();
    let policy_text = block("worked-example-policy");
    let model =
        confed_worker_api::model::encode_f32_tensors(&[("dense.bias", vec![2], &[0.0, 0.0])])
            .unwrap();
    let context = envelope::RoundContext {
        task_id: ex["task_id"].clone(),
        round: ex["round"].parse().unwrap(),
        policy_sha256: confed_protocol::policy::sha256_hex(policy_text.as_bytes()),
        model_sha256: confed_protocol::policy::sha256_hex(&model),
    };
    let update = hex(&ex["update"]);
    let sealed = envelope::seal(
        &public,
        &ex["key_id"],
        &context,
        &ex["assignment_id"].as_str().into(),
        &update,
    )
    .unwrap();
    let h = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    println!("policy_sha256          {}", context.policy_sha256);
    println!("model                  {}", h(&model));
    println!("model_sha256           {}", context.model_sha256);
    println!(
        "info                   {}",
        h(&envelope::info(&ex["key_id"]))
    );
    let reference = envelope::assignment_ref(&ex["assignment_id"]);
    println!(
        "aad                    {}",
        h(&envelope::aad(&context, &reference))
    );
    println!("envelope               {}", h(&sealed.to_cbor()));
}
