//! JSON integers as JSON Schema means them: `6131.0` is the integer 6131 (JSON Schema's
//! `integer` is any number with a zero fractional part), while serde's `i64` refuses it. Fields
//! the OpenAPI document declares as integers take both spellings; `6131.5` is still refused.

use serde::{Deserialize, Deserializer};

fn integral<E: serde::de::Error>(number: serde_json::Number) -> Result<i64, E> {
    if let Some(value) = number.as_i64() {
        return Ok(value);
    }
    match number.as_f64() {
        Some(value) if value.fract() == 0.0 && value.abs() < 9.007_199_254_740_992e15 => {
            Ok(value as i64)
        }
        _ => Err(E::custom(format!("{number} is not an integer"))),
    }
}

/// An optional integer field.
pub fn option_i64<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<i64>, D::Error> {
    Option::<serde_json::Number>::deserialize(deserializer)?
        .map(integral)
        .transpose()
}

/// A required integer field.
pub fn i64<'de, D: Deserializer<'de>>(deserializer: D) -> Result<i64, D::Error> {
    integral(serde_json::Number::deserialize(deserializer)?)
}

#[cfg(test)]
mod tests {
    #[derive(Debug, serde::Deserialize)]
    struct Sample {
        #[serde(deserialize_with = "super::i64")]
        n: i64,
        #[serde(default, deserialize_with = "super::option_i64")]
        o: Option<i64>,
    }

    #[test]
    fn integral_floats_are_integers_and_fractions_are_not() {
        let parse = |text: &str| serde_json::from_str::<Sample>(text);
        assert_eq!(parse(r#"{"n": 6131.0, "o": 2}"#).unwrap().n, 6131);
        assert_eq!(parse(r#"{"n": 1, "o": 7.0}"#).unwrap().o, Some(7));
        assert_eq!(parse(r#"{"n": 1}"#).unwrap().o, None);
        assert_eq!(parse(r#"{"n": 1, "o": null}"#).unwrap().o, None);
        assert!(parse(r#"{"n": 6131.5}"#).is_err());
        assert!(parse(r#"{"n": 1e300}"#).is_err());
        assert!(parse(r#"{"n": "1"}"#).is_err());
    }
}
