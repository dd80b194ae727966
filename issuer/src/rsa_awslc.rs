//! The issuer's blind signature over AWS-LC's RSA private operation (`RSA_sign_raw` without
//! padding: CRT, with AWS-LC's own blinding, constant-time), about three times the speed of the
//! pure-Rust `crypto-bigint` path in `confed_protocol::privacy_pass::issuance`, which stays the
//! reference (the tests check both give the RFC 9578 vectors' responses). Every signature is
//! checked with the public operation (`RSA_verify_raw`) before it leaves: a faulty private
//! operation must never hand out a value that could leak a factor of the modulus.
//!
//! This is the issuer's only `unsafe` code: one owned `RSA*`, every call's return value checked,
//! every buffer bounded by the length AWS-LC is told.

use aws_lc_sys as lc;
use confed_protocol::privacy_pass::AUTHENTICATOR_BYTES;

/// An RSA-2048 private key loaded into AWS-LC.
pub struct AwsLcSigner {
    rsa: *mut lc::RSA,
}

// SAFETY: AWS-LC's RSA private operations are safe to call concurrently on one RSA object (it
// locks its blinding and Montgomery caches internally); the key is never modified after `new`.
unsafe impl Send for AwsLcSigner {}
unsafe impl Sync for AwsLcSigner {}

impl Drop for AwsLcSigner {
    fn drop(&mut self) {
        // SAFETY: `rsa` came from EVP_PKEY_get1_RSA (a reference we own) and is freed once;
        // AWS-LC cleanses the key material.
        unsafe { lc::RSA_free(self.rsa) }
    }
}

impl AwsLcSigner {
    /// From the PKCS#8 DER of an RSA-2048 key.
    pub fn from_pkcs8_der(der: &[u8]) -> Option<Self> {
        let len = std::os::raw::c_long::try_from(der.len()).ok()?;
        // SAFETY: `input` points into `der`, which outlives the call, and `len` is its length;
        // the EVP_PKEY returned (or null, checked) is owned here and freed once; the RSA
        // reference EVP_PKEY_get1_RSA returns is owned by the signer.
        unsafe {
            let mut input = der.as_ptr();
            let pkey = lc::d2i_AutoPrivateKey(std::ptr::null_mut(), &mut input, len);
            if pkey.is_null() {
                return None;
            }
            let rsa = lc::EVP_PKEY_get1_RSA(pkey);
            lc::EVP_PKEY_free(pkey);
            if rsa.is_null() {
                return None;
            }
            let signer = Self { rsa };
            (lc::RSA_size(rsa) as usize == AUTHENTICATOR_BYTES).then_some(signer)
        }
    }

    /// `blinded^d mod n`, checked by raising it to `e`; `None` if the blinded message is not
    /// below the modulus or the check fails.
    pub fn sign(&self, blinded: &[u8; AUTHENTICATOR_BYTES]) -> Option<[u8; AUTHENTICATOR_BYTES]> {
        let mut signature = [0u8; AUTHENTICATOR_BYTES];
        let mut check = [0u8; AUTHENTICATOR_BYTES];
        let (mut written, mut checked) = (0usize, 0usize);
        // SAFETY: every pointer is to a live buffer of the length passed with it; `rsa` is a
        // valid key (see `from_pkcs8_der`).
        let ok = unsafe {
            lc::RSA_sign_raw(
                self.rsa,
                &mut written,
                signature.as_mut_ptr(),
                signature.len(),
                blinded.as_ptr(),
                blinded.len(),
                lc::RSA_NO_PADDING,
            ) == 1
                && lc::RSA_verify_raw(
                    self.rsa,
                    &mut checked,
                    check.as_mut_ptr(),
                    check.len(),
                    signature.as_ptr(),
                    signature.len(),
                    lc::RSA_NO_PADDING,
                ) == 1
        };
        // SAFETY: ERR_clear_error only empties this thread's error queue.
        unsafe { lc::ERR_clear_error() };
        (ok && written == AUTHENTICATOR_BYTES
            && checked == AUTHENTICATOR_BYTES
            && check == *blinded)
            .then_some(signature)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use confed_protocol::privacy_pass::issuance::TokenSigner;
    use confed_protocol::privacy_pass::{TokenRequest, TokenResponse};

    #[test]
    fn aws_lc_signs_the_vectors_blinded_messages_to_their_responses_and_refuses_oversized_ones() {
        let cases: Vec<std::collections::BTreeMap<String, String>> = serde_json::from_str(
            include_str!("../../protocol/testdata/privacy_pass_type2_vectors.json"),
        )
        .unwrap();
        for case in cases {
            let bytes = |k: &str| confed_protocol::hex::decode(&case[k]).unwrap();
            let reference = TokenSigner::from_pem(&case["skS_pem"]).unwrap();
            let signer = AwsLcSigner::from_pkcs8_der(&reference.pkcs8_der().unwrap()).unwrap();
            let request = TokenRequest::decode(&bytes("token_request")).unwrap();
            let signature = signer.sign(&request.blinded_msg).unwrap();
            assert_eq!(
                TokenResponse {
                    blind_sig: signature
                }
                .encode(),
                bytes("token_response")
            );
            assert!(signer.sign(&[0xff; AUTHENTICATOR_BYTES]).is_none());
        }
        assert!(AwsLcSigner::from_pkcs8_der(b"not a key").is_none());
    }
}
