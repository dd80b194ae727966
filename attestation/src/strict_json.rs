//! JSON that means one thing: objects with a duplicate member name are refused. RFC 8259 leaves
//! duplicates' meaning to the parser (serde_json keeps the last, others the first), so a token
//! carrying `"aud": "ours", "aud": "theirs"` could pass one verifier's check and another's too.

use std::collections::HashSet;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

/// Checks that `bytes` is JSON in which no object repeats a member name (at any depth).
pub fn reject_duplicate_keys(bytes: &[u8]) -> Result<(), String> {
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    Unique
        .deserialize(&mut deserializer)
        .map_err(|e| e.to_string())?;
    deserializer.end().map_err(|e| e.to_string())
}

struct Unique;

impl<'de> DeserializeSeed<'de> for Unique {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Unique {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JSON")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Unique)?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut seen = HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key.clone()) {
                return Err(de::Error::custom(format!(
                    "member {key:?} appears twice in one object"
                )));
            }
            map.next_value_seed(Unique)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicate_members_are_refused_at_any_depth() {
        assert!(reject_duplicate_keys(br#"{"a": 1, "b": [1, {"c": 2}]}"#).is_ok());
        let error = reject_duplicate_keys(br#"{"aud": "ours", "aud": "theirs"}"#).unwrap_err();
        assert!(error.contains("\"aud\" appears twice"), "{error}");
        assert!(reject_duplicate_keys(br#"{"s": {"x": 1, "x": 2}}"#).is_err());
        assert!(reject_duplicate_keys(br#"[{"x": 1}, {"x": 2}]"#).is_ok());
        assert!(reject_duplicate_keys(br#"{"a": 1} trailing"#).is_err());
        assert!(
            reject_duplicate_keys(br#"{"a": "\u0061", "\u0061": 2}"#).is_err(),
            "escapes decoded"
        );
    }
}
