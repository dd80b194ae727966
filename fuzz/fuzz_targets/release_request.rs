//! Any bytes as a key-service release request body: decoding must never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = confed_attestation::exchange::ReleaseRequest::decode(data);
});
