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

    /// Not ready while any part cannot take evidence (the operator should act), though the
    /// others still attest (`unavailable_for`).
    fn unavailable(&self, now: Seconds) -> Option<String> {
        let reasons: Vec<String> = self
            .0
            .iter()
            .filter_map(|part| Some(format!("{}: {}", part.format(), part.unavailable(now)?)))
            .collect();
        (!reasons.is_empty()).then(|| reasons.join("; "))
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
