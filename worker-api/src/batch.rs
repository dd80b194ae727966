//! Several contributions in one exchange (`POST /internal/v1/contributions`, docs/protocol.md,
//! "Worker API"): the worker names up to `MAX_BATCH_KEYS` contribution keys, and the server
//! answers with one frame per key, in the order named, streamed as it reads them.
//!
//! A frame is an 8-byte big-endian length followed by that many bytes (the stored envelope), or
//! the length `MISSING` alone for a contribution the store does not have. The body is exactly the
//! frames: one that ends early, or goes on after the last, is refused (the server cut it off
//! after a read failed, or something between the two changed it).
//!
//! One request per contribution cost the server about 0.1 CPU-seconds per GB of a round of 1 MB
//! contributions in per-request work (routing, wake-ups, allocations) on top of moving the
//! bytes, and a round of small contributions mostly that (docs/performance.md, "Batched
//! contribution reads").

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Most keys one batch names.
pub const MAX_BATCH_KEYS: usize = 64;

/// The length of a frame that stands for a missing contribution.
pub const MISSING: u64 = u64::MAX;

/// Bytes of a frame's length.
pub const HEADER_BYTES: usize = 8;

/// `POST /internal/v1/contributions`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchRequest {
    /// 1 to `MAX_BATCH_KEYS` contribution keys (the job's listed ones).
    pub keys: Vec<String>,
}

/// The header of a frame of `length` bytes, or of a missing contribution (`None`).
pub fn frame_header(length: Option<usize>) -> [u8; HEADER_BYTES] {
    length.map_or(MISSING, |l| l as u64).to_be_bytes()
}

/// A whole body of `frames` at once (a missing contribution as `None`): the server streams the
/// same frames one by one as it reads them.
pub fn encode(frames: &[Option<&[u8]>]) -> Vec<u8> {
    let mut body = Vec::new();
    for frame in frames {
        body.extend_from_slice(&frame_header(frame.map(<[u8]>::len)));
        body.extend_from_slice(frame.unwrap_or_default());
    }
    body
}

/// What is wrong with a batch's body.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum FrameError {
    #[error("the batch's body ended after {read} of its {expected} contributions")]
    Truncated { read: usize, expected: usize },
    #[error("the batch's body goes on after its {expected} contributions")]
    TrailingBytes { expected: usize },
}

/// Decodes a batch's frames from its body's chunks as they arrive, into buffers the caller
/// hands it (pooled ones: a round reuses them instead of a fresh allocation per contribution).
pub struct FrameDecoder {
    expected: usize,
    done: usize,
    header: [u8; HEADER_BYTES],
    header_len: usize,
    /// The frame being filled and the bytes it still lacks.
    body: Option<(Vec<u8>, usize)>,
    /// Most bytes reserved up front on a frame's length (the server's word): a longer frame
    /// grows its buffer as it arrives.
    max_reserve: usize,
}

impl FrameDecoder {
    /// A decoder for a body of `expected` frames.
    pub fn new(expected: usize, max_reserve: usize) -> Self {
        Self {
            expected,
            done: 0,
            header: [0; HEADER_BYTES],
            header_len: 0,
            body: None,
            max_reserve,
        }
    }

    /// Feeds the body's next `chunk`; every frame it completes goes to `out`, in order, its
    /// bytes in a buffer from `take` (a missing contribution as `None`).
    pub fn feed(
        &mut self,
        mut chunk: &[u8],
        take: &mut impl FnMut() -> Vec<u8>,
        out: &mut impl FnMut(Option<Vec<u8>>),
    ) -> Result<(), FrameError> {
        while !chunk.is_empty() {
            if let Some((buffer, lacking)) = &mut self.body {
                let now = (*lacking).min(chunk.len());
                buffer.extend_from_slice(&chunk[..now]);
                *lacking -= now;
                chunk = &chunk[now..];
                if *lacking == 0 {
                    let (buffer, _) = self.body.take().expect("a frame being filled");
                    self.done += 1;
                    out(Some(buffer));
                }
                continue;
            }
            if self.done == self.expected {
                return Err(FrameError::TrailingBytes {
                    expected: self.expected,
                });
            }
            let now = (HEADER_BYTES - self.header_len).min(chunk.len());
            self.header[self.header_len..self.header_len + now].copy_from_slice(&chunk[..now]);
            self.header_len += now;
            chunk = &chunk[now..];
            if self.header_len < HEADER_BYTES {
                continue;
            }
            self.header_len = 0;
            match u64::from_be_bytes(self.header) {
                MISSING => {
                    self.done += 1;
                    out(None);
                }
                length => {
                    // A length beyond the address space cannot be filled: the body ends first.
                    let length = usize::try_from(length).unwrap_or(usize::MAX);
                    let mut buffer = take();
                    buffer.clear();
                    buffer.reserve(length.min(self.max_reserve));
                    if length == 0 {
                        self.done += 1;
                        out(Some(buffer));
                    } else {
                        self.body = Some((buffer, length));
                    }
                }
            }
        }
        Ok(())
    }

    /// The body has ended: every frame must be complete.
    pub fn finish(&self) -> Result<(), FrameError> {
        if self.done < self.expected || self.body.is_some() || self.header_len > 0 {
            return Err(FrameError::Truncated {
                read: self.done,
                expected: self.expected,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(
        body: &[u8],
        cuts: &[usize],
        expected: usize,
    ) -> Result<Vec<Option<Vec<u8>>>, FrameError> {
        let mut decoder = FrameDecoder::new(expected, 1 << 20);
        let mut frames = Vec::new();
        let mut start = 0;
        for &cut in cuts.iter().chain([body.len()].iter()) {
            decoder.feed(&body[start..cut], &mut Vec::new, &mut |f| frames.push(f))?;
            start = cut;
        }
        decoder.finish()?;
        Ok(frames)
    }

    #[test]
    fn frames_come_out_in_order_however_the_body_is_cut() {
        let frames: [Option<&[u8]>; 4] = [Some(b"first"), None, Some(b""), Some(b"fourth one")];
        let body = encode(&frames);
        let want: Vec<Option<Vec<u8>>> = frames.iter().map(|f| f.map(<[u8]>::to_vec)).collect();
        assert_eq!(decode(&body, &[], 4).unwrap(), want);
        for cut in 0..=body.len() {
            assert_eq!(decode(&body, &[cut], 4).unwrap(), want, "cut at {cut}");
        }
        let every_byte: Vec<usize> = (1..body.len()).collect();
        assert_eq!(decode(&body, &every_byte, 4).unwrap(), want);
    }

    #[test]
    fn a_body_cut_short_anywhere_is_refused() {
        let body = encode(&[Some(b"first"), None, Some(b"third")]);
        for end in 0..body.len() {
            let error = decode(&body[..end], &[], 3).unwrap_err();
            assert!(
                matches!(error, FrameError::Truncated { expected: 3, .. }),
                "end {end}"
            );
        }
    }

    #[test]
    fn a_body_that_goes_on_after_its_frames_is_refused() {
        let mut long = encode(&[Some(b"one"), None]);
        long.push(0);
        assert_eq!(
            decode(&long, &[], 2).unwrap_err(),
            FrameError::TrailingBytes { expected: 2 }
        );
        // One frame more than named is trailing bytes too.
        let three = encode(&[Some(b"one"), None, Some(b"extra")]);
        assert!(decode(&three, &[], 2).is_err());
    }

    #[test]
    fn a_frame_fills_a_pooled_buffer_whatever_it_held() {
        let body = encode(&[Some(b"new")]);
        let mut decoder = FrameDecoder::new(1, 1 << 20);
        let mut frames = Vec::new();
        decoder
            .feed(&body, &mut || b"stale contents".to_vec(), &mut |f| {
                frames.push(f)
            })
            .unwrap();
        decoder.finish().unwrap();
        assert_eq!(frames, [Some(b"new".to_vec())]);
    }

    #[test]
    fn a_claimed_length_reserves_no_more_than_the_cap() {
        let mut header = frame_header(Some(1 << 40)).to_vec();
        header.extend_from_slice(b"abc");
        let mut decoder = FrameDecoder::new(1, 4096);
        decoder.feed(&header, &mut Vec::new, &mut |_| {}).unwrap();
        let (buffer, lacking) = decoder.body.as_ref().unwrap();
        assert!(buffer.capacity() < 1 << 20, "{}", buffer.capacity());
        assert_eq!(*lacking, (1 << 40) - 3);
        assert!(decoder.finish().is_err());
    }
}
