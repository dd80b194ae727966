//! The key services' masking keys and the task policy's `masking` line (docs/secure-
//! aggregation.md, docs/protocol.md "Masks").
//!
//! Each key service holds one X25519 *masking key*, apart from its shares: devices seal their
//! mask seeds to it. It publishes the public half in its key set (`GET /v1/keys`, `masking_key`),
//! signed with its key-set signing key over
//!
//! ```text
//! confed-masking-key-v1|<keyservice_id>|<public_key base64url>
//! ```
//!
//! A masked task's policy names every key service, in the order that numbers them 1 to `n`:
//!
//! ```text
//! masking=confed-masking/v1;threshold=<t>;services=<id>:<verifying_key>:<public_key>:<signature>,...
//! ```
//!
//! The signature travels inside the policy, so the policy's hash (which every contribution
//! binds) fixes the keys, and a device checks each against the key service its trust file lists
//! under that id (the same verifying key, and a valid signature) before it seals anything: an
//! operator that wrote keys of its own into a policy gets no device to seal to them. The key
//! services check each other's unmask receipts with the verifying keys named here: the release
//! ledger pins a task's policy hash at its first release, so they are the ones devices accepted.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use p256::ecdsa::signature::{Signer, Verifier};
use p256::ecdsa::{Signature, SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};

use crate::hpke::PublicKey;
use crate::keys::valid_id;
use crate::masking::{Layout, MAX_SERVICES, Ring, SCHEME};
use crate::policy::TaskPolicy;

pub const KEY_LABEL: &str = "confed-masking-key-v1";

/// A key service's masking key as its key set publishes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignedMaskingKey {
    /// X25519 public key, base64url.
    pub public_key: String,
    /// ECDSA P-256 / SHA-256 over `key_message`, 64 bytes r||s, base64url.
    pub signature: String,
}

/// The bytes a key service signs for its masking key.
pub fn key_message(keyservice_id: &str, public_key: &str) -> Vec<u8> {
    format!("{KEY_LABEL}|{keyservice_id}|{public_key}").into_bytes()
}

/// Signs `public` as the masking key of `keyservice_id`.
pub fn sign_masking_key(
    signing_key: &SigningKey,
    keyservice_id: &str,
    public: &PublicKey,
) -> SignedMaskingKey {
    let public_key = URL_SAFE_NO_PAD.encode(public.0);
    // Low `s` (BIP 62 style): one key has one signature text, so one policy has one hash.
    let signature: Signature = signing_key.sign(&key_message(keyservice_id, &public_key));
    let signature = signature.normalize_s();
    SignedMaskingKey {
        public_key,
        signature: URL_SAFE_NO_PAD.encode(signature.to_bytes()),
    }
}

/// Whether `key` is signed by `keyservice_id` with `verifying_key`.
pub fn verify_masking_key(
    verifying_key: &VerifyingKey,
    keyservice_id: &str,
    key: &SignedMaskingKey,
) -> bool {
    let Ok(bytes) = URL_SAFE_NO_PAD.decode(&key.signature) else {
        return false;
    };
    let Ok(signature) = Signature::from_slice(&bytes) else {
        return false;
    };
    verifying_key
        .verify(&key_message(keyservice_id, &key.public_key), &signature)
        .is_ok()
}

/// One key service of a masked task: its id, its key-set verifying key (base64url SEC1, as its
/// key set publishes it) and its signed masking key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MaskingService {
    pub keyservice_id: String,
    pub verifying_key: String,
    pub key: SignedMaskingKey,
}

impl MaskingService {
    /// The key-set verifying key it signs with: the uncompressed SEC1 point only (65 bytes), so
    /// one key has one text in the policy.
    pub fn verifying_key(&self) -> Result<VerifyingKey, String> {
        let uncompressed = URL_SAFE_NO_PAD
            .decode(&self.verifying_key)
            .is_ok_and(|bytes| bytes.len() == 65 && bytes[0] == 4);
        uncompressed
            .then(|| crate::keyset::decode_verifying_key(&self.verifying_key))
            .flatten()
            .ok_or_else(|| {
                format!(
                    "key service {}: the verifying key is not a base64url SEC1 P-256 point",
                    self.keyservice_id
                )
            })
    }

    /// Whether its masking key carries its own signature.
    pub fn signed(&self) -> bool {
        self.verifying_key()
            .is_ok_and(|key| verify_masking_key(&key, &self.keyservice_id, &self.key))
    }

    /// The masking key as an HPKE recipient key.
    pub fn public_key(&self) -> Result<PublicKey, String> {
        URL_SAFE_NO_PAD
            .decode(&self.key.public_key)
            .ok()
            .and_then(|bytes| PublicKey::from_bytes(&bytes).ok())
            .ok_or_else(|| {
                format!(
                    "key service {}: the masking key is not a base64url X25519 public key",
                    self.keyservice_id
                )
            })
    }
}

/// The policy's `masking` line: the scheme, the release threshold, distributed noise if the task
/// asks for it, and the key services in the order that numbers them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MaskingPolicy {
    pub threshold: u8,
    /// The ring the masks live in (`ring=32` in the line; absent: 2^64).
    pub ring: Ring,
    /// Distributed noise (docs/secure-aggregation.md, "Distributed noise"): the integer variance,
    /// in grid units squared, of the discrete Gaussian every group's holders add to that group's
    /// mask sums. `None`: the enclave noises the unmasked sum itself.
    pub noise_variance: Option<u64>,
    pub services: Vec<MaskingService>,
}

/// The largest distributed-noise variance (grid units squared): the exact sampler's range.
pub const MAX_NOISE_VARIANCE: u64 = 1 << 60;

impl MaskingPolicy {
    /// Checks the layout, the ids and the keys' encodings (not the signatures: that is the
    /// device's check, against its own trust file).
    pub fn new(threshold: u8, services: Vec<MaskingService>) -> Result<Self, String> {
        let n = services.len();
        if n == 0 || n > usize::from(MAX_SERVICES) {
            return Err(format!(
                "masking takes 1 to {MAX_SERVICES} key services, not {n}"
            ));
        }
        Layout::new(n as u8, threshold).map_err(|e| format!("masking: {e}"))?;
        let mut ids = std::collections::BTreeSet::new();
        let mut keys = std::collections::BTreeSet::new();
        for service in &services {
            if !valid_id(&service.keyservice_id) {
                return Err("masking: a key service id must be 1-64 of A-Z a-z 0-9 . _ -".into());
            }
            if !ids.insert(service.keyservice_id.as_str()) {
                return Err(format!(
                    "masking: key service {} is named twice",
                    service.keyservice_id
                ));
            }
            service.verifying_key()?;
            let key = service.public_key()?;
            if !keys.insert(key.0) {
                return Err("masking: two key services have the same masking key".into());
            }
            // 64 bytes r || s with a low `s`: the other form of the same signature would give
            // the same policy a second text (and hash).
            let signature = URL_SAFE_NO_PAD
                .decode(&service.key.signature)
                .ok()
                .and_then(|bytes| Signature::from_slice(&bytes).ok());
            if !signature.is_some_and(|s| s.normalize_s() == s) {
                return Err(format!(
                    "masking: key service {}: the signature is not 64 bytes of base64url r || s with a low s",
                    service.keyservice_id
                ));
            }
        }
        Ok(Self {
            threshold,
            ring: Ring::Bits64,
            noise_variance: None,
            services,
        })
    }

    /// The same line with distributed noise of `variance` per group (1 to `MAX_NOISE_VARIANCE`).
    pub fn with_noise(mut self, variance: u64) -> Result<Self, String> {
        if !(1..=MAX_NOISE_VARIANCE).contains(&variance) {
            return Err(format!(
                "masking: the distributed noise's variance must be 1 to {MAX_NOISE_VARIANCE} grid units squared, not {variance}"
            ));
        }
        self.noise_variance = Some(variance);
        Ok(self)
    }

    /// The same line with the masks in `ring`.
    pub fn with_ring(mut self, ring: Ring) -> Self {
        self.ring = ring;
        self
    }

    /// The replicated-seed layout of these services, in the line's ring.
    pub fn layout(&self) -> Layout {
        Layout::new(self.services.len() as u8, self.threshold)
            .expect("checked when the policy was made")
            .with_ring(self.ring)
    }

    /// The number (1 to `n`) of the key service `keyservice_id`, if the policy names it.
    pub fn number_of(&self, keyservice_id: &str) -> Option<u8> {
        self.services
            .iter()
            .position(|s| s.keyservice_id == keyservice_id)
            .map(|i| i as u8 + 1)
    }

    /// The masking keys, service 1 first.
    pub fn public_keys(&self) -> Vec<PublicKey> {
        self.services
            .iter()
            .map(|s| s.public_key().expect("checked when the policy was made"))
            .collect()
    }

    pub fn encode(&self) -> String {
        let services: Vec<String> = self
            .services
            .iter()
            .map(|s| {
                format!(
                    "{}:{}:{}:{}",
                    s.keyservice_id, s.verifying_key, s.key.public_key, s.key.signature
                )
            })
            .collect();
        let ring = match self.ring {
            Ring::Bits64 => "",
            Ring::Bits32 => ";ring=32",
        };
        let noise = match self.noise_variance {
            Some(variance) => format!(";noise={variance}"),
            None => String::new(),
        };
        format!(
            "{SCHEME};threshold={}{ring}{noise};services={}",
            self.threshold,
            services.join(",")
        )
    }

    pub fn parse(text: &str) -> Result<Self, String> {
        let malformed = || {
            format!(
                "`masking` must be `{SCHEME};threshold=<t>[;ring=32][;noise=<variance>];services=<id>:<verifying_key>:<key>:<signature>,...`"
            )
        };
        let rest = text
            .strip_prefix(SCHEME)
            .and_then(|r| r.strip_prefix(";threshold="))
            .ok_or_else(malformed)?;
        let (head, services) = rest.split_once(";services=").ok_or_else(malformed)?;
        let (head, noise) = match head.split_once(";noise=") {
            Some((head, noise)) => (head, Some(noise)),
            None => (head, None),
        };
        let (threshold, ring) = match head.split_once(";ring=") {
            Some((threshold, "32")) => (threshold, Ring::Bits32),
            Some(_) => return Err(malformed()),
            None => (head, Ring::Bits64),
        };
        let threshold: u8 = threshold.parse().map_err(|_| malformed())?;
        let noise: Option<u64> = noise
            .map(|n| n.parse().map_err(|_| malformed()))
            .transpose()?;
        let services = services
            .split(',')
            .map(|entry| {
                let parts: Vec<&str> = entry.split(':').collect();
                match parts[..] {
                    [id, verifying_key, key, signature] => Ok(MaskingService {
                        keyservice_id: id.to_string(),
                        verifying_key: verifying_key.to_string(),
                        key: SignedMaskingKey {
                            public_key: key.to_string(),
                            signature: signature.to_string(),
                        },
                    }),
                    _ => Err(malformed()),
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut policy = Self::new(threshold, services)?.with_ring(ring);
        if let Some(variance) = noise {
            policy = policy.with_noise(variance)?;
        }
        if policy.encode() != text {
            return Err(format!(
                "`masking` is not in canonical form: {}",
                malformed()
            ));
        }
        Ok(policy)
    }
}

/// Why a masked policy cannot run (docs/secure-aggregation.md): the key services must check
/// that the seeds they sum are genuine devices' (device tokens whose nonce binds them), and
/// what the enclave adds besides the update's sum needs masked slots of its own (not built).
pub(crate) fn policy_problems(policy: &TaskPolicy) -> Vec<String> {
    let mut problems = Vec::new();
    if policy.device_auth.is_none() {
        problems.push(
            "masking requires device_auth: the key services add a device's masks only under a token that binds its seeds"
                .to_string(),
        );
    }
    if policy.analytics.is_some() {
        problems.push("masking is for training tasks; an analytics task cannot mask".into());
    }
    if let Ok(mechanism) = policy.dp_mechanism() {
        let unmasked = [
            (
                mechanism.adaptive_clipping.is_some(),
                "adaptive clipping (the device clips to the policy's fixed clip norm)",
            ),
            (
                mechanism.evaluation.is_some(),
                "evaluation (its metrics are not masked yet)",
            ),
            (
                mechanism.health.is_some(),
                "health (its flag is not masked yet)",
            ),
            (
                mechanism.weighting.is_some(),
                "weighting (its example counts are not masked yet)",
            ),
        ];
        for (_, what) in unmasked.iter().filter(|(on, _)| *on) {
            problems.push(format!("a masked task cannot use {what}"));
        }
        let distributed = policy
            .masking
            .as_ref()
            .is_some_and(|m| m.noise_variance.is_some());
        if distributed && mechanism.noise != crate::mechanism::Mechanism::Gaussian {
            problems.push(format!(
                "distributed noise is per-round Gaussian noise; the mechanism {} correlates its noise across rounds, which only the enclave can draw",
                mechanism.noise.encode()
            ));
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keyset::generate_signing_key;

    pub(crate) fn signed_services(n: usize) -> (Vec<SigningKey>, Vec<MaskingService>) {
        let signers: Vec<SigningKey> = (0..n).map(|_| generate_signing_key()).collect();
        let services = signers
            .iter()
            .enumerate()
            .map(|(i, signer)| {
                let (_, public) = crate::hpke::generate_keypair();
                let id = format!("ks{}", i + 1);
                MaskingService {
                    key: sign_masking_key(signer, &id, &public),
                    verifying_key: crate::keyset::encode_verifying_key(signer.verifying_key()),
                    keyservice_id: id,
                }
            })
            .collect();
        (signers, services)
    }

    #[test]
    fn a_masking_line_round_trips_and_numbers_its_services() {
        let (_, services) = signed_services(3);
        let policy = MaskingPolicy::new(2, services).unwrap();
        let text = policy.encode();
        assert!(text.starts_with("confed-masking/v1;threshold=2;services=ks1:"));
        assert!(policy.services.iter().all(MaskingService::signed));
        assert_eq!(MaskingPolicy::parse(&text).unwrap(), policy);
        assert_eq!(policy.number_of("ks3"), Some(3));
        assert_eq!(policy.number_of("ks4"), None);
        assert_eq!(policy.layout().quorum(), 3);
        assert_eq!(policy.public_keys().len(), 3);
    }

    #[test]
    fn a_masking_line_with_distributed_noise_round_trips_in_one_form_only() {
        let (_, services) = signed_services(3);
        let policy = MaskingPolicy::new(2, services)
            .unwrap()
            .with_noise(4_294_967_296)
            .unwrap();
        let text = policy.encode();
        assert!(text.starts_with("confed-masking/v1;threshold=2;noise=4294967296;services=ks1:"));
        assert_eq!(MaskingPolicy::parse(&text).unwrap(), policy);
        for bad in [
            text.replace("noise=4294967296", "noise=04294967296"),
            text.replace("noise=4294967296", "noise=0"),
            text.replace("noise=4294967296", "noise=1152921504606846977"),
            text.replace("noise=4294967296", "noise=-1"),
            text.replace(
                "threshold=2;noise=4294967296",
                "noise=4294967296;threshold=2",
            ),
        ] {
            assert!(MaskingPolicy::parse(&bad).is_err(), "{bad}");
        }
        let plain = MaskingPolicy::new(2, policy.services.clone()).unwrap();
        assert!(plain.clone().with_noise(0).is_err());
        assert!(plain.with_noise(MAX_NOISE_VARIANCE).is_ok());
    }

    #[test]
    fn a_masking_line_in_the_ring_of_2_32_says_so_before_its_noise_and_only_as_32() {
        let (_, services) = signed_services(3);
        let policy = MaskingPolicy::new(2, services)
            .unwrap()
            .with_ring(Ring::Bits32)
            .with_noise(99)
            .unwrap();
        let text = policy.encode();
        assert!(text.starts_with("confed-masking/v1;threshold=2;ring=32;noise=99;services=ks1:"));
        assert_eq!(MaskingPolicy::parse(&text).unwrap(), policy);
        assert_eq!(policy.layout().ring(), Ring::Bits32);
        for bad in [
            text.replace("ring=32", "ring=64"),
            text.replace("ring=32", "ring=032"),
            text.replace("ring=32;noise=99", "noise=99;ring=32"),
        ] {
            assert!(MaskingPolicy::parse(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_masking_line_that_names_a_service_twice_or_a_bad_layout_is_refused() {
        let (_, services) = signed_services(3);
        let mut twice = services.clone();
        twice[2].keyservice_id = "ks1".into();
        assert!(MaskingPolicy::new(2, twice).unwrap_err().contains("twice"));
        let mut same_key = services.clone();
        same_key[2].key.public_key = same_key[0].key.public_key.clone();
        assert!(
            MaskingPolicy::new(2, same_key)
                .unwrap_err()
                .contains("same masking key")
        );
        assert!(MaskingPolicy::new(4, services.clone()).is_err(), "t > n");
        assert!(MaskingPolicy::new(0, services.clone()).is_err(), "t = 0");
        let (_, eight) = signed_services(8);
        assert!(MaskingPolicy::new(3, eight).is_err(), "more than 7");
        let text = MaskingPolicy::new(2, services).unwrap().encode();
        for bad in [
            text.replace("threshold=2", "threshold=02"),
            text.replace(";services=", ";keys="),
            format!("{text},"),
            text.replacen(":", "::", 1),
        ] {
            assert!(MaskingPolicy::parse(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_masking_key_verifies_only_under_its_own_service_and_key() {
        let (signers, services) = signed_services(2);
        let verifying = signers[0].verifying_key();
        assert!(verify_masking_key(verifying, "ks1", &services[0].key));
        assert!(!verify_masking_key(verifying, "ks2", &services[0].key));
        assert!(!verify_masking_key(verifying, "ks1", &services[1].key));
        let mut swapped = services[0].key.clone();
        swapped.public_key = services[1].key.public_key.clone();
        assert!(!verify_masking_key(verifying, "ks1", &swapped));
    }

    fn masked_policy(services: Vec<MaskingService>) -> TaskPolicy {
        let mut policy = TaskPolicy::sample("masked-task", 3);
        policy.device_auth = Some(
            crate::device_auth::DeviceAuth::new(
                "issuer.example",
                vec![crate::device_auth::tests::vector_key()],
            )
            .unwrap(),
        );
        policy.masking = Some(MaskingPolicy::new(2, services).unwrap());
        policy
    }

    #[test]
    fn a_masked_policy_text_parses_back_and_passes_the_enclave_limits() {
        let (_, services) = signed_services(3);
        let policy = masked_policy(services);
        let text = policy.encode();
        let line = text.lines().find(|l| l.starts_with("masking=")).unwrap();
        assert!(text.find("device_auth=").unwrap() < text.find(line).unwrap());
        assert_eq!(TaskPolicy::parse(&text).unwrap(), policy);
        policy.check_enclave_limits().unwrap();
    }

    #[test]
    fn a_masked_policy_without_tokens_or_with_unmasked_side_values_is_refused_with_the_reason() {
        let (_, services) = signed_services(3);
        let mut no_tokens = masked_policy(services.clone());
        no_tokens.device_auth = None;
        let why = no_tokens.check_enclave_limits().unwrap_err().to_string();
        assert!(why.contains("masking requires device_auth"), "{why}");
        for (suffix, named) in [
            (";health=1e0", "health"),
            (";weighting=examples,10", "weighting"),
        ] {
            let mut policy = masked_policy(services.clone());
            policy.mechanism = format!("{}{suffix}", crate::policy::MECHANISM);
            assert!(policy.dp_mechanism().is_ok(), "{suffix} parses");
            let why = policy.check_enclave_limits().unwrap_err().to_string();
            assert!(why.contains(&format!("cannot use {named}")), "{why}");
        }
    }

    fn trust_of(signers: &[SigningKey], threshold: usize) -> crate::trust::TrustConfig {
        crate::trust::TrustConfig {
            threshold,
            keyservices: signers
                .iter()
                .enumerate()
                .map(|(i, s)| crate::trust::TrustedEntry {
                    id: format!("ks{}", i + 1),
                    verifying_key: crate::keyset::encode_verifying_key(s.verifying_key()),
                })
                .collect(),
            shares: None,
            limits: crate::policy::DeviceLimits::ENCLAVE,
            tenant_id: None,
            token_issuers: Vec::new(),
            require_masking: false,
            require_distributed_noise: false,
        }
    }

    #[test]
    fn a_device_seals_seeds_only_to_masking_keys_its_trusted_services_signed() {
        let (signers, services) = signed_services(3);
        let policy = masked_policy(services.clone());
        let trust = trust_of(&signers, 2);
        let keys = trust.accept_masking(&policy).unwrap().unwrap();
        assert_eq!(keys, policy.masking.as_ref().unwrap().public_keys());
        assert_eq!(
            trust.accept_masking(&TaskPolicy::sample("plain", 1)),
            Ok(None)
        );
        // A device that requires masking refuses the same task served in the clear.
        let strict = crate::trust::TrustConfig {
            require_masking: true,
            require_distributed_noise: false,
            ..trust.clone()
        };
        assert!(strict.accept_masking(&policy).is_ok());
        let why = strict
            .accept_masking(&TaskPolicy::sample("plain", 1))
            .unwrap_err()
            .to_string();
        assert!(why.contains("requires masking"), "{why}");
        // A device that requires distributed noise refuses a masked task without it, and the
        // same task with it.
        let noised = crate::trust::TrustConfig {
            require_distributed_noise: true,
            ..trust.clone()
        };
        let why = noised.accept_masking(&policy).unwrap_err().to_string();
        assert!(why.contains("require_distributed_noise"), "{why}");
        let mut with_noise = policy.clone();
        with_noise.masking = with_noise.masking.map(|m| m.with_noise(1 << 32).unwrap());
        assert!(noised.accept_masking(&with_noise).unwrap().is_some());
        assert!(
            noised
                .accept_masking(&TaskPolicy::sample("plain", 1))
                .is_err()
        );

        // The operator puts a key of its own in place of ks2's.
        let mut forged = services.clone();
        let (_, own) = crate::hpke::generate_keypair();
        forged[1].key.public_key = URL_SAFE_NO_PAD.encode(own.0);
        let why = trust
            .accept_masking(&masked_policy(forged))
            .unwrap_err()
            .to_string();
        assert!(why.contains("not signed by it"), "{why}");

        // ... or a key and verifying key of its own, the key signed under it.
        let impostor = generate_signing_key();
        let mut posing = services.clone();
        posing[1].key = sign_masking_key(&impostor, "ks2", &own);
        posing[1].verifying_key = crate::keyset::encode_verifying_key(impostor.verifying_key());
        assert!(posing[1].signed());
        let why = trust
            .accept_masking(&masked_policy(posing))
            .unwrap_err()
            .to_string();
        assert!(why.contains("not signed by it"), "{why}");

        // A service the device does not list, or another layout than the one it pins.
        let mut stranger = services.clone();
        stranger[2].keyservice_id = "ks9".into();
        assert!(
            trust
                .accept_masking(&masked_policy(stranger))
                .unwrap_err()
                .to_string()
                .contains("does not list")
        );
        assert!(
            trust_of(&signers, 3)
                .accept_masking(&policy)
                .unwrap_err()
                .to_string()
                .contains("pins 3 of 3")
        );
    }
}
