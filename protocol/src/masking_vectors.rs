//! `tests/vectors/masking.json`: what a device in another language must compute byte for byte in
//! a masked task (clients/python/tests/test_masking.py checks the Python package against it):
//! the layout's groups, the grid values of a clipped update, the masked update's bytes under
//! fixed seeds (in the rings of 2^64 and 2^32), each key service's sealed-seeds associated data, and the v2 token nonce.

use super::*;
use crate::privacy_pass::context::{masked_token_nonce, seeds_digest};

const REF: &str = "5d9ec1f4a7a2c1d3f2e7b8a9c0d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9";
const POLICY: &str = "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0";

fn seed(group: usize) -> [u8; SEED_BYTES] {
    std::array::from_fn(|i| (group * 31 + i) as u8)
}

fn case(n: u8, t: u8, ring: Ring, update: &[f32], clip_norm: f64) -> serde_json::Value {
    let layout = Layout::new(n, t).unwrap().with_ring(ring);
    let context = MaskContext::new("task-v", 7, REF, POLICY, update.len()).unwrap();
    let grid = crate::grid::clip_to_grid(update, clip_norm);
    let seeds: Vec<Seed> = (0..layout.groups().len())
        .map(|g| Seed::from_bytes(seed(g)))
        .collect();
    let masked = mask(&layout, &grid, &seeds, &context).unwrap();
    let aads: Vec<String> = (1..=n)
        .map(|j| crate::hex::encode(seeds_aad(&context, j)))
        .collect();
    // A nonce over made-up sealed items: the formula, not HPKE's randomness.
    let items: Vec<Vec<u8>> = (1..=n).map(|j| vec![j; sealed_len(&layout, j)]).collect();
    let digests: Vec<[u8; 32]> = items.iter().map(|i| seeds_digest(i)).collect();
    serde_json::json!({
        "services": n,
        "threshold": t,
        "ring": ring.bits(),
        "task_id": "task-v",
        "round": 7,
        "assignment_ref": REF,
        "policy_sha256": POLICY,
        "update": update,
        "clip_norm": clip_norm,
        "groups": layout.groups(),
        "seeds_hex": (0..layout.groups().len()).map(|g| crate::hex::encode(seed(g))).collect::<Vec<_>>(),
        "grid": grid,
        "masked_update_hex": crate::hex::encode(encode_masked(&masked, ring)),
        "seeds_aad_hex": aads,
        "sealed_lengths": (1..=n).map(|j| sealed_len(&layout, j)).collect::<Vec<_>>(),
        "enc_hex": crate::hex::encode([9u8; 32]),
        "sealed_item_bytes": "service j's item is `sealed_lengths[j-1]` bytes, all equal to j",
        "nonce_hex": crate::hex::encode(masked_token_nonce(&[9u8; 32], &digests)),
    })
}

#[test]
fn the_cross_language_vectors_are_what_this_library_computes() {
    let path =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/vectors/masking.json");
    let vectors = vec![
        case(3, 2, Ring::Bits64, &[0.25, -0.5, 0.125, 0.0], 1.0),
        // Above the clip norm, with a tie on the grid and a value that rounds to zero.
        case(5, 3, Ring::Bits64, &[3.0, -4.0, 1e-9, 0.5], 2.5),
        case(7, 3, Ring::Bits64, &[1.0; 5], 1.0),
        // The ring of 2^32: 4-byte words of the same streams, a U32 tensor.
        case(3, 2, Ring::Bits32, &[0.25, -0.5, 0.125, 0.0], 1.0),
        case(5, 3, Ring::Bits32, &[3.0, -4.0, 1e-9, 0.5], 2.5),
    ];
    let text = serde_json::to_string_pretty(&vectors).unwrap() + "\n";
    if std::env::var_os("CONFED_UPDATE_VECTORS").is_some() {
        std::fs::write(&path, &text).unwrap();
    }
    let stored = std::fs::read_to_string(&path)
        .expect("tests/vectors/masking.json (CONFED_UPDATE_VECTORS=1 writes it)");
    assert_eq!(
        stored, text,
        "the masking vectors changed: the Python package must change with them"
    );
}
