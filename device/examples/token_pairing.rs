//! How well a token issuer and a front end that collude can pair a device's token request (the
//! issuer knows which attested device asked) with its assignment and upload (the front end knows
//! when each assignment was created and when its upload arrived), by time alone.
//!
//! Devices are assigned as a Poisson process; each draws its send instant and its token instant
//! as `SendTimes::draw` does (docs/protocol.md, "Upload window"). For each token request the
//! attackers' best single guess is the assignment, live at that moment, whose interval from
//! assignment to upload is shortest (the token instant is uniform on that interval, so a shorter
//! one makes the request likelier). Printed: the share of requests they pair correctly, against
//! the chance of 1 in the live assignments and against the earlier behaviour (a token requested
//! 9-60 ms after the assignment, as issue 45 measured).
//!
//! ```text
//! cargo run --release -p confed-device --example token_pairing
//! ```

use confed_device::SendTimes;
use confed_protocol::clock::Millis;
use confed_protocol::policy::UploadWindow;

/// splitmix64: a fixed stream, so the figures are the same on every run.
struct Stream(u64);

impl Stream {
    fn unit(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (((z ^ (z >> 31)) >> 11) as f64) / (1u64 << 53) as f64
    }
}

struct Device {
    assigned: i64,
    token: i64,
    sent: i64,
}

/// `devices` assignments at `per_second`, under `window`, token instants by `token_at`.
fn population(
    devices: usize,
    per_second: f64,
    window: UploadWindow,
    stream: &mut Stream,
    drawn_token: bool,
) -> Vec<Device> {
    let mut now = 0.0f64;
    (0..devices)
        .map(|_| {
            now += -(1.0 - stream.unit()).ln() / per_second * 1000.0;
            let assigned = Millis(now as i64);
            let times = SendTimes::draw(
                assigned,
                window,
                Millis(i64::MAX / 2),
                stream.unit(),
                stream.unit(),
            );
            let token = if drawn_token {
                times.token_ms
            } else {
                assigned.0 + 9 + (stream.unit() * 51.0) as i64
            };
            Device {
                assigned: assigned.0,
                token,
                sent: times.send_ms,
            }
        })
        .collect()
}

/// The likelihood of a token request at `token` from the device of `d`, under each behaviour:
/// uniform between assignment and upload (drawn), or 9-60 ms after the assignment (before).
fn drawn_density(d: &Device, token: i64) -> f64 {
    match (d.assigned..=d.sent).contains(&token) {
        true => 1.0 / (d.sent - d.assigned + 1) as f64,
        false => 0.0,
    }
}

fn before_density(d: &Device, token: i64) -> f64 {
    match (d.assigned + 9..=d.assigned + 60).contains(&token) {
        true => 1.0 / 52.0,
        false => 0.0,
    }
}

/// The share of token requests the attackers pair with the right assignment (their guess: the
/// likeliest one under `density`), and the mean number of assignments that could have made a
/// request.
fn pairing(devices: &[Device], density: fn(&Device, i64) -> f64) -> (f64, f64) {
    let (mut right, mut live_total) = (0usize, 0usize);
    for (index, device) in devices.iter().enumerate() {
        let live: Vec<(usize, f64)> = devices
            .iter()
            .enumerate()
            .map(|(i, d)| (i, density(d, device.token)))
            .filter(|(_, p)| *p > 0.0)
            .collect();
        live_total += live.len();
        let guess = live
            .iter()
            .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)))
            .map(|(i, _)| *i);
        right += usize::from(guess == Some(index));
    }
    (
        right as f64 / devices.len() as f64,
        live_total as f64 / devices.len() as f64,
    )
}

fn main() {
    const DEVICES: usize = 4_000;
    let windows = [
        (
            "demo 0.3-0.6 s",
            UploadWindow::new(300, 600).expect("a window"),
        ),
        (
            "default 60-120 s",
            UploadWindow::new(60_000, 120_000).expect("a window"),
        ),
    ];
    println!(
        "{:<18} {:>12} {:>14} {:>12} {:>16}",
        "upload window", "assignments/s", "live at token", "paired", "before (9-60 ms)"
    );
    for (name, window) in windows {
        for per_second in [0.1, 1.0, 10.0, 100.0] {
            let mut stream = Stream(45);
            let drawn = population(DEVICES, per_second, window, &mut stream, true);
            let mut stream = Stream(45);
            let before = population(DEVICES, per_second, window, &mut stream, false);
            let (paired, live) = pairing(&drawn, drawn_density);
            let (paired_before, _) = pairing(&before, before_density);
            println!(
                "{name:<18} {per_second:>12} {live:>14.1} {:>11.1}% {:>15.1}%",
                paired * 100.0,
                paired_before * 100.0
            );
        }
    }
}
