//! A range of loopback ports for the listeners the embedded default starts by itself (its key
//! services; the demo's API too), so that a demo or a test can be kept inside ports a firewall,
//! a container or a test harness allows (`confed serve --embedded-ports 18090-18099`). Without
//! one, the operating system picks free ports.

use std::net::Ipv4Addr;
use std::str::FromStr;

use thiserror::Error;
use tokio::net::TcpListener;

/// An inclusive range of TCP ports, `start <= end`, never port 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortRange {
    pub start: u16,
    pub end: u16,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum PortRangeError {
    #[error(
        "{0:?} is not a port range: give START-END, e.g. 18090-18099 (ports 1-65535, START <= END)"
    )]
    Malformed(String),
    #[error(
        "no free port on 127.0.0.1 in {start}-{end} (all {count} taken); widen --embedded-ports or free one"
    )]
    Exhausted { start: u16, end: u16, count: u32 },
    #[error("cannot listen on 127.0.0.1:{port}: {reason}")]
    Listen { port: u16, reason: String },
}

impl FromStr for PortRange {
    type Err = PortRangeError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let malformed = || PortRangeError::Malformed(text.to_string());
        let (start, end) = text.trim().split_once('-').ok_or_else(malformed)?;
        let port = |p: &str| p.parse::<u16>().ok().filter(|&p| p > 0);
        match (port(start), port(end)) {
            (Some(start), Some(end)) if start <= end => Ok(Self { start, end }),
            _ => Err(malformed()),
        }
    }
}

impl std::fmt::Display for PortRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.start, self.end)
    }
}

impl PortRange {
    /// How many ports the range holds.
    pub fn len(&self) -> u32 {
        u32::from(self.end) - u32::from(self.start) + 1
    }

    /// Never true: a range holds its start.
    pub fn is_empty(&self) -> bool {
        false
    }
}

/// A loopback listener: on the first free port of `range` (in order), or on any free port
/// without one. A port another process holds is skipped; any other failure is an error.
pub async fn bind_loopback(range: Option<PortRange>) -> Result<TcpListener, PortRangeError> {
    let Some(range) = range else {
        return TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .map_err(|e| PortRangeError::Listen {
                port: 0,
                reason: e.to_string(),
            });
    };
    for port in range.start..=range.end {
        match TcpListener::bind((Ipv4Addr::LOCALHOST, port)).await {
            Ok(listener) => return Ok(listener),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => continue,
            Err(e) => {
                return Err(PortRangeError::Listen {
                    port,
                    reason: e.to_string(),
                });
            }
        }
    }
    Err(PortRangeError::Exhausted {
        start: range.start,
        end: range.end,
        count: range.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_parses_as_start_dash_end_and_nothing_else() {
        assert_eq!(
            "18090-18099".parse(),
            Ok(PortRange {
                start: 18090,
                end: 18099
            })
        );
        assert_eq!("7-7".parse::<PortRange>().unwrap().len(), 1);
        for bad in [
            "",
            "18090",
            "18099-18090",
            "0-10",
            "1-65536",
            "a-b",
            "1-2-3",
            "-5",
        ] {
            assert!(bad.parse::<PortRange>().is_err(), "{bad:?} was accepted");
        }
        let error = "18090".parse::<PortRange>().unwrap_err().to_string();
        assert!(error.contains("give START-END"), "{error}");
    }

    #[tokio::test]
    async fn listeners_take_the_free_ports_of_the_range_in_order_then_say_it_is_full() {
        // A range of two ports that were free a moment ago (bound, then released).
        let (a, b) = loop {
            let first = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let port = first.local_addr().unwrap().port();
            if port < u16::MAX
                && let Ok(second) = std::net::TcpListener::bind(("127.0.0.1", port + 1))
            {
                drop((first, second));
                break (port, port + 1);
            }
        };
        let range = PortRange { start: a, end: b };
        let first = bind_loopback(Some(range)).await.unwrap();
        let second = bind_loopback(Some(range)).await.unwrap();
        assert_eq!(first.local_addr().unwrap().port(), a);
        assert_eq!(second.local_addr().unwrap().port(), b);
        assert_eq!(
            bind_loopback(Some(range)).await.unwrap_err(),
            PortRangeError::Exhausted {
                start: a,
                end: b,
                count: 2
            }
        );
        assert_ne!(
            bind_loopback(None)
                .await
                .unwrap()
                .local_addr()
                .unwrap()
                .port(),
            0
        );
    }
}
