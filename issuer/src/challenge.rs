//! Attestation challenges that cost the issuer no state: `issued_at (8 bytes, big-endian Unix
//! seconds) || 16 random bytes || tag`, where `tag` is the first 16 bytes of HMAC-SHA256 under a
//! key this process drew at start. A device's evidence must bind one (Android: the key
//! description's `attestationChallenge`; dev: the signed message) issued in the last
//! `CHALLENGE_TTL_SECONDS`, so recorded evidence goes stale. A challenge need not be single use:
//! every grant counts against the device's per-window limit, however often it attests.

use protocol::clock::Seconds;
use subtle::ConstantTimeEq;

use confed_protocol as protocol;

/// How long a challenge stays usable (seconds): room for an Android device to generate an
/// attested key in secure hardware (seconds on slow StrongBox chips).
pub const CHALLENGE_TTL_SECONDS: i64 = 300;
pub const CHALLENGE_BYTES: usize = 40;
const DOMAIN: &[u8] = b"confed-issuer-challenge-v1\0";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChallengeProblem {
    /// Not issued by this process (or malformed, or issued before a restart).
    Unknown,
    Expired,
}

impl ChallengeProblem {
    pub fn reason(self) -> &'static str {
        match self {
            Self::Unknown => {
                "the challenge was not issued by this issuer (or it restarted since); request a new one"
            }
            Self::Expired => "the challenge expired; request a new one and attest again",
        }
    }
}

pub struct Challenges {
    key: ring::hmac::Key,
}

impl std::fmt::Debug for Challenges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Challenges")
    }
}

impl Challenges {
    pub fn new() -> Result<Self, getrandom::Error> {
        let mut key = zeroize::Zeroizing::new([0u8; 32]);
        getrandom::fill(key.as_mut())?;
        Ok(Self {
            key: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key.as_ref()),
        })
    }

    fn tag(&self, body: &[u8]) -> [u8; 16] {
        let mut context = ring::hmac::Context::with_key(&self.key);
        context.update(DOMAIN);
        context.update(body);
        let mut tag = [0u8; 16];
        tag.copy_from_slice(&context.sign().as_ref()[..16]);
        tag
    }

    pub fn issue(&self, now: Seconds) -> Result<[u8; CHALLENGE_BYTES], getrandom::Error> {
        let mut out = [0u8; CHALLENGE_BYTES];
        out[..8].copy_from_slice(&now.0.to_be_bytes());
        getrandom::fill(&mut out[8..24])?;
        let tag = self.tag(&out[..24]);
        out[24..].copy_from_slice(&tag);
        Ok(out)
    }

    /// Checks that `challenge` is one of ours and still fresh at `now`.
    pub fn check(&self, challenge: &[u8], now: Seconds) -> Result<(), ChallengeProblem> {
        if challenge.len() != CHALLENGE_BYTES {
            return Err(ChallengeProblem::Unknown);
        }
        let tag = self.tag(&challenge[..24]);
        if !bool::from(tag.ct_eq(&challenge[24..])) {
            return Err(ChallengeProblem::Unknown);
        }
        let issued_at = i64::from_be_bytes(challenge[..8].try_into().expect("8 bytes"));
        if now.0 < issued_at || now.0 - issued_at > CHALLENGE_TTL_SECONDS {
            return Err(ChallengeProblem::Expired);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_challenge_is_ours_fresh_and_tamper_evident() {
        let challenges = Challenges::new().unwrap();
        let challenge = challenges.issue(Seconds(1_000)).unwrap();
        assert_eq!(challenges.check(&challenge, Seconds(1_000)), Ok(()));
        assert_eq!(challenges.check(&challenge, Seconds(1_300)), Ok(()));
        assert_eq!(
            challenges.check(&challenge, Seconds(1_301)),
            Err(ChallengeProblem::Expired)
        );
        assert_eq!(
            challenges.check(&challenge, Seconds(999)),
            Err(ChallengeProblem::Expired)
        );
        let mut forged = challenge;
        forged[..8].copy_from_slice(&5_000i64.to_be_bytes());
        assert_eq!(
            challenges.check(&forged, Seconds(5_000)),
            Err(ChallengeProblem::Unknown)
        );
        let other = Challenges::new().unwrap();
        assert_eq!(
            other.check(&challenge, Seconds(1_000)),
            Err(ChallengeProblem::Unknown)
        );
        assert_eq!(
            challenges.check(&challenge[..39], Seconds(1_000)),
            Err(ChallengeProblem::Unknown)
        );
    }
}
