//! Shamir secret sharing of a private key over GF(256) (blahaj, the maintained fork of sharks with
//! unbiased coefficients). A share is `x || y`: one byte of x coordinate (1..=255), then one byte of
//! y per secret byte.

use blahaj::{Share, Sharks};
use thiserror::Error;
use zeroize::Zeroizing;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ShareError {
    #[error(
        "threshold {threshold} and share count {shares} must satisfy 2 <= threshold <= shares <= 255"
    )]
    Parameters { threshold: u16, shares: u16 },
    #[error("a share must be 2 or more bytes (x coordinate, then data)")]
    Malformed,
    #[error("{0}")]
    Combine(String),
}

/// Checks share parameters as the ceremony requires them: 2 <= T <= N <= 255.
pub fn check_parameters(threshold: u16, shares: u16) -> Result<(), ShareError> {
    if 2 <= threshold && threshold <= shares && shares <= 255 {
        Ok(())
    } else {
        Err(ShareError::Parameters { threshold, shares })
    }
}

/// Splits `secret` into `shares` shares, any `threshold` of which recover it.
pub fn split(
    secret: &[u8],
    threshold: u16,
    shares: u16,
) -> Result<Vec<Zeroizing<Vec<u8>>>, ShareError> {
    check_parameters(threshold, shares)?;
    Ok(Sharks(threshold as u8)
        .dealer(secret)
        .take(shares as usize)
        .map(|share| Zeroizing::new(Vec::from(&share)))
        .collect())
}

/// The x coordinate of a share, which identifies it (the key service's index).
pub fn share_index(share: &[u8]) -> Option<u8> {
    share.first().copied().filter(|_| share.len() >= 2)
}

/// Recovers the secret from at least `threshold` shares with distinct x coordinates.
pub fn combine(threshold: u16, shares: &[&[u8]]) -> Result<Zeroizing<Vec<u8>>, ShareError> {
    let parsed: Vec<Share> = shares
        .iter()
        .map(|bytes| {
            if bytes.len() < 2 {
                return Err(ShareError::Malformed);
            }
            Share::try_from(*bytes).map_err(|_| ShareError::Malformed)
        })
        .collect::<Result<_, _>>()?;
    let mut xs: Vec<u8> = shares.iter().map(|s| s[0]).collect();
    xs.sort_unstable();
    xs.dedup();
    if xs.len() != shares.len() {
        return Err(ShareError::Combine("two shares have the same index".into()));
    }
    let threshold = u8::try_from(threshold).map_err(|_| ShareError::Parameters {
        threshold,
        shares: 0,
    })?;
    Sharks(threshold)
        .recover(parsed.iter())
        .map(Zeroizing::new)
        .map_err(|e| ShareError::Combine(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_threshold_subset_recovers_and_fewer_do_not() {
        let secret = [7u8; 32];
        let shares = split(&secret, 3, 5).unwrap();
        let refs: Vec<&[u8]> = shares.iter().map(|s| s.as_slice()).collect();
        for subset in [[0, 1, 2], [0, 2, 4], [1, 3, 4], [2, 3, 4]] {
            let picked: Vec<&[u8]> = subset.iter().map(|&i| refs[i]).collect();
            assert_eq!(combine(3, &picked).unwrap().as_slice(), &secret);
        }
        assert!(combine(3, &refs[..2]).is_err());
        let indices: Vec<_> = refs.iter().map(|s| share_index(s).unwrap()).collect();
        assert_eq!(indices, [1, 2, 3, 4, 5]);
    }

    #[test]
    fn parameters_outside_the_allowed_range_are_refused() {
        for (t, n) in [(1, 3), (4, 3), (2, 256), (0, 0)] {
            assert!(split(&[1], t, n).is_err(), "{t}-of-{n}");
        }
        assert!(split(&[1], 255, 255).is_ok());
    }

    #[test]
    fn duplicate_or_malformed_shares_are_refused() {
        let shares = split(&[9u8; 4], 2, 3).unwrap();
        assert!(combine(2, &[&shares[0], &shares[0]]).is_err());
        assert_eq!(
            combine(2, &[&shares[0], &[1u8]]),
            Err(ShareError::Malformed)
        );
    }
}
