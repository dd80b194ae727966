//! Which path an update takes through the aggregator (held whole or streamed chunk by chunk)
//! and the order its tensors are stored in never change its norm or the sum.

use super::tests::{Normal, ROUND, binding, round, sealed, update};
use super::*;

/// `update(values)` with the tensors' data stored in the other order ("w" first, then "b"), as
/// safetensors allows: the same update to the enclave.
fn update_stored_in_reverse(values: &[f32]) -> Vec<u8> {
    let w = (values.len() - 2) * 4;
    let mut header = format!(
        r#"{{"b":{{"dtype":"F32","shape":[2],"data_offsets":[{w},{}]}},"w":{{"dtype":"F32","shape":[{}],"data_offsets":[0,{w}]}}}}"#,
        w + 8,
        values.len() - 2
    );
    while !(header.len() + 8).is_multiple_of(8) {
        header.push(' ');
    }
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header.as_bytes());
    for v in values[2..].iter().chain(&values[..2]) {
        bytes.extend(v.to_le_bytes());
    }
    bytes
}

/// Which path an update takes (streamed or held whole) and the order its tensors are stored in
/// never change the sum: the norm that decides clipping is measured per tensor, in schema order
/// (to the bit: `a_real_streamed_update_measures_the_buffered_norm_to_the_bit`). Updates far
/// above, just above and just below the clip norm, around the aim inside it, and well below.
#[test]
fn the_path_and_the_tensor_order_never_change_the_sum() {
    let len = 300_000; // two chunks, cut inside "w"
    let r = round(len);
    let mut rng = Normal::seeded(23);
    let shape: Vec<f32> = (0..len)
        .map(|i| rng.normal() * 2f32.powi((i % 37) as i32 - 18))
        .collect();
    let norm = shape
        .iter()
        .map(|&v| f64::from(v).powi(2))
        .sum::<f64>()
        .sqrt();
    // Far above, just above, just below and well below the clip norm of 1.
    let updates: Vec<Vec<f32>> = [40.0, 1.000_01, 0.999_99, 0.999_97, 0.5]
        .iter()
        .map(|target| {
            shape
                .iter()
                .map(|&v| (f64::from(v) * target / norm) as f32)
                .collect()
        })
        .collect();
    let run = |stream_above: usize, encode: fn(&[f32]) -> Vec<u8>| {
        let agg = Aggregator::new(binding(), 1.0, r.schema.clone(), &r.private)
            .unwrap()
            .stream_above(stream_above);
        for (i, values) in updates.iter().enumerate() {
            let (id, bytes) = sealed(&r, &format!("d{i}"), ROUND, &encode(values));
            agg.add(&id, Some(&bytes)).unwrap();
        }
        agg.sum.into_sum()
    };
    let expected = run(usize::MAX, update);
    assert_eq!(run(0, update), expected, "streamed");
    assert_eq!(
        run(usize::MAX, update_stored_in_reverse),
        expected,
        "stored in reverse"
    );
    assert_eq!(
        run(0, update_stored_in_reverse),
        expected,
        "streamed, stored in reverse"
    );
}

/// The norm a streamed update measures chunk by chunk (its tensors stored in reverse, "w" cut
/// between two chunks) is the one the buffered path measures over the same plaintext, to the
/// bit, on values whose norm would show any other order of additions.
#[test]
fn a_real_streamed_update_measures_the_buffered_norm_to_the_bit() {
    let len = 300_000;
    let r = round(len);
    let mut rng = Normal::seeded(29);
    let values: Vec<f32> = (0..len)
        .map(|i| rng.normal() * 2f32.powi((i % 41) as i32 - 20))
        .collect();
    let agg = Aggregator::new(binding(), 1.0, r.schema.clone(), &r.private).unwrap();
    for plaintext in [update(&values), update_stored_in_reverse(&values)] {
        let (id, bytes) = sealed(&r, "d", ROUND, &plaintext);
        let envelope = contribution::parse(&agg.binding, &bytes).unwrap();
        let streamed = stream::ChunkedUpdate::new(
            &agg.recipient,
            envelope,
            &agg.binding.context,
            &id,
            &agg.schema,
            agg.sides(),
        )
        .expect("a chunked envelope");
        let streamed = accumulator::Accumulator::measure_stream(&streamed).expect("streamable");
        let tensors = contribution::tensors(&agg.schema, &plaintext, agg.sides()).unwrap();
        let buffered = quantize::measure(&tensors.model);
        assert_eq!(
            streamed.norm_squared.to_bits(),
            buffered.norm_squared.to_bits()
        );
        assert_eq!(streamed.nonzero, buffered.nonzero);
    }
}
