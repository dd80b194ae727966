//! Several attesters behind one issuer, chosen by the evidence's `format`: an app that runs on
//! Android and iOS has one issuer (the one its tasks' policies name) for both. Each part keeps
//! its own availability: a stale Android status list stops Android attestations, not Apple's.
//! The dev attester never joins them (it would let anyone beside the genuine devices).

use super::{AttestError, Attester, DeviceIdentity, Evidence, FailedCheck, Seconds};

#[derive(Debug)]
pub struct Attesters(Vec<Box<dyn Attester>>);

impl Attesters {
    /// `parts` of distinct formats, none insecure; `None` otherwise.
    pub fn new(parts: Vec<Box<dyn Attester>>) -> Option<Self> {
        let mut formats: Vec<_> = parts.iter().map(|part| part.format()).collect();
        formats.sort_unstable();
        formats.dedup();
        let acceptable = !parts.is_empty()
            && formats.len() == parts.len()
            && parts.iter().all(|part| !part.insecure());
        acceptable.then_some(Self(parts))
    }

    fn part_for(&self, evidence: &Evidence) -> Option<&dyn Attester> {
        self.0
            .iter()
            .find(|part| part.format() == evidence.format())
            .map(AsRef::as_ref)
    }
}

impl Attester for Attesters {
    fn format(&self) -> &'static str {
        self.0[0].format()
    }

    fn formats(&self) -> Vec<&'static str> {
        self.0.iter().map(|part| part.format()).collect()
    }

    fn insecure(&self) -> bool {
        false
    }

    /// Not ready only while no part can take evidence: a stale Android status list must not cut
    /// off iOS devices (its 503s still count in `confed_issuer_refusals_total`, and it is
    /// logged at every probe).
    fn unavailable(&self, now: Seconds) -> Option<String> {
        let reasons: Vec<String> = self
            .0
            .iter()
            .filter_map(|part| Some(format!("{}: {}", part.format(), part.unavailable(now)?)))
            .collect();
        if reasons.len() < self.0.len() {
            for reason in &reasons {
                tracing::warn!(%reason, "one attester cannot take evidence; the others can");
            }
            return None;
        }
        Some(reasons.join("; "))
    }

    fn unavailable_for(&self, evidence: &Evidence, now: Seconds) -> Option<String> {
        self.part_for(evidence)?.unavailable(now)
    }

    fn attest(
        &self,
        evidence: &Evidence,
        challenge: &[u8],
        now: Seconds,
    ) -> Result<DeviceIdentity, AttestError> {
        match self.part_for(evidence) {
            Some(part) => part.attest(evidence, challenge, now),
            None => Err(FailedCheck::format(&self.formats()).into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Part(&'static str, Option<&'static str>);

    impl Attester for Part {
        fn format(&self) -> &'static str {
            self.0
        }
        fn insecure(&self) -> bool {
            false
        }
        fn unavailable(&self, _now: Seconds) -> Option<String> {
            self.1.map(String::from)
        }
        fn attest(
            &self,
            _: &Evidence,
            _: &[u8],
            _: Seconds,
        ) -> Result<DeviceIdentity, AttestError> {
            Ok(DeviceIdentity([0; 32]))
        }
    }

    fn several(android: Option<&'static str>, apple: Option<&'static str>) -> Attesters {
        Attesters::new(vec![
            Box::new(Part("android-key-attestation", android)),
            Box::new(Part("apple-app-attest", apple)),
        ])
        .unwrap()
    }

    #[test]
    fn one_part_unavailable_refuses_its_own_evidence_only_and_the_issuer_stays_ready() {
        let stale = several(Some("stale status list"), None);
        assert_eq!(stale.unavailable(Seconds(0)), None);
        let android = Evidence::AndroidKeyAttestation {
            certificate_chain: vec![],
        };
        let apple = Evidence::AppleAppAttest {
            key_id: String::new(),
            attestation: None,
            assertion: None,
        };
        assert_eq!(
            stale.unavailable_for(&android, Seconds(0)).as_deref(),
            Some("stale status list")
        );
        assert_eq!(stale.unavailable_for(&apple, Seconds(0)), None);
        let both = several(Some("stale"), Some("down"));
        assert_eq!(
            both.unavailable(Seconds(0)).as_deref(),
            Some("android-key-attestation: stale; apple-app-attest: down")
        );
        // Same formats twice, or a dev part, are refused.
        assert!(
            Attesters::new(vec![
                Box::new(Part("apple-app-attest", None)),
                Box::new(Part("apple-app-attest", None)),
            ])
            .is_none()
        );
        assert!(Attesters::new(vec![Box::new(crate::attester::dev::DevAttester)]).is_none());
    }
}
