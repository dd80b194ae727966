//! The send instant with tokio's paused clock: time moves only when every task waits (or the test
//! advances it), so each case states exactly when the update was taken, without sleeping.

use super::*;
use safetensors::SafeTensors;

fn f32_tensor(name: &str, values: &[f32]) -> Vec<u8> {
    let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![values.len()], &data)
            .unwrap();
    safetensors::serialize([(name, view)], None).unwrap()
}

/// Under a health policy: every update carries the flag.
fn shape() -> UpdateShape {
    UpdateShape::of_model(&f32_tensor("w", &[1.0, 2.0, 3.0]))
        .unwrap()
        .reporting_health(true)
}

const HEALTH: &str = confed_protocol::policy::HEALTH_TENSOR;

fn trained() -> Trained {
    Trained {
        update: Ok(f32_tensor("w", &[0.25, -0.5, 1.0])),
        metrics: Some(Ok([1.5, 2.0, 3.0])),
        examples: None,
    }
}

fn values(due: &DueUpdate, name: &str) -> Vec<f32> {
    let parsed = SafeTensors::deserialize(due.update().bytes()).unwrap();
    parsed
        .tensor(name)
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// A schedule whose send instant is `send_ms` from now (the token instant half-way).
fn schedule_in(send_ms: i64) -> Schedule {
    let now = Millis(1_700_000_000_000);
    let times = SendTimes {
        received_ms: now.0,
        token_ms: now.0 + send_ms / 2,
        send_ms: now.0 + send_ms,
    };
    Schedule::new("ref".into(), times, now, Instant::now())
}

const SEND_MS: i64 = 40_000;

#[tokio::test(start_paused = true)]
async fn fast_training_is_sent_at_the_drawn_instant_not_when_it_ends() {
    let started = Instant::now();
    let schedule = schedule_in(SEND_MS);
    let due = schedule.train_until(&shape(), true, |_| trained()).await;
    assert_eq!(started.elapsed(), Duration::from_millis(SEND_MS as u64));
    assert!(!due.late() && !due.zeroed(), "{:?}", due.problems());
    assert_eq!(values(&due, "w"), [0.25, -0.5, 1.0]);
    assert_eq!(values(&due, HEALTH), [0.0]);
    assert_eq!(
        values(&due, confed_protocol::policy::EVALUATION_TENSOR),
        [1.5, 2.0, 3.0]
    );
}

#[tokio::test(start_paused = true)]
async fn slow_training_is_stopped_and_zeros_go_at_the_drawn_instant() {
    let started = Instant::now();
    let schedule = schedule_in(SEND_MS);
    let (stopped_tx, stopped_rx) = std::sync::mpsc::channel();
    let sending = tokio::spawn(async move {
        schedule
            .train_until(&shape(), true, move |cancel| {
                // Training on subnormals: far slower than the window, until told to stop.
                while !cancel.is_cancelled() {
                    std::thread::park_timeout(Duration::from_millis(1));
                }
                stopped_tx.send(()).unwrap();
                trained()
            })
            .await
    });
    tokio::time::advance(Duration::from_millis(SEND_MS as u64)).await;
    let due = sending.await.unwrap();
    assert_eq!(started.elapsed(), Duration::from_millis(SEND_MS as u64));
    assert!(due.late() && due.zeroed());
    assert_eq!(due.problems(), [TrainingProblem::Late]);
    assert_eq!(values(&due, "w"), [0.0; 3]);
    assert_eq!(values(&due, HEALTH), [1.0], "zeros sent: the flag says so");
    assert_eq!(
        values(&due, confed_protocol::policy::EVALUATION_TENSOR),
        [0.0; 3]
    );
    stopped_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("training was told to stop");
}

#[tokio::test(start_paused = true)]
async fn a_result_finished_past_the_instant_is_dropped() {
    let started = Instant::now();
    let schedule = schedule_in(SEND_MS);
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let sending = tokio::spawn(async move {
        schedule
            .train_until(&shape(), false, move |_| {
                // Ignores the cancel flag: returns only once the test lets it, after the instant.
                let _ = release_rx.recv_timeout(Duration::from_secs(30));
                trained()
            })
            .await
    });
    tokio::time::advance(Duration::from_millis(SEND_MS as u64)).await;
    let due = sending.await.unwrap();
    release_tx.send(()).unwrap();
    assert_eq!(started.elapsed(), Duration::from_millis(SEND_MS as u64));
    assert!(due.late());
    assert_eq!(values(&due, "w"), [0.0; 3]);
}

#[tokio::test(start_paused = true)]
async fn failing_non_finite_or_panicking_training_sends_zeros_at_the_drawn_instant() {
    type Trainer = fn(&Cancel) -> Trained;
    let cases: [(&str, Trainer); 3] = [
        ("failing", |_| Trained {
            update: Err("too few examples".into()),
            metrics: None,
            examples: None,
        }),
        ("non-finite", |_| Trained {
            update: Ok(f32_tensor("w", &[f32::NAN, 0.0, 0.0])),
            metrics: None,
            examples: None,
        }),
        ("panicking", |_| panic!("the trainer panicked on purpose")),
    ];
    for (case, train) in cases {
        let started = Instant::now();
        let due = schedule_in(SEND_MS)
            .train_until(&shape(), false, train)
            .await;
        assert_eq!(
            started.elapsed(),
            Duration::from_millis(SEND_MS as u64),
            "{case}"
        );
        assert!(due.zeroed() && !due.late(), "{case}: {:?}", due.problems());
        assert_eq!(values(&due, "w"), [0.0; 3], "{case}");
        assert_eq!(values(&due, HEALTH), [1.0], "{case}");
    }
}

#[tokio::test(start_paused = true)]
async fn an_instant_already_past_sends_at_once() {
    let now = Millis(1_700_000_000_000);
    let times = SendTimes {
        received_ms: now.0 - 90_000,
        token_ms: now.0 - 60_000,
        send_ms: now.0 - 30_000,
    };
    let started = Instant::now();
    let schedule = Schedule::new("ref".into(), times, now, started);
    assert_eq!(schedule.send_at(), started);
    let due = schedule.train_until(&shape(), false, |_| trained()).await;
    assert_eq!(started.elapsed(), Duration::ZERO);
    // Nothing was ready at the instant (training had not even started): zeros.
    assert!(due.late());
}

#[tokio::test(start_paused = true)]
async fn a_state_file_instant_far_in_the_future_waits_at_most_eight_days() {
    let now = Millis(1_700_000_000_000);
    let times = SendTimes {
        received_ms: now.0,
        token_ms: i64::MAX,
        send_ms: i64::MAX,
    };
    let at = Instant::now();
    let schedule = Schedule::new("ref".into(), times, now, at);
    assert_eq!(schedule.send_at() - at, LONGEST_WAIT);
}

#[test]
fn draws_fall_in_the_window_the_token_before_the_send_and_both_before_expiry() {
    let received = Millis(1_000_000);
    let window = UploadWindow::new(10_000, 20_000).unwrap();
    let expires = Millis(1_000_000 + 600_000);
    for (send_unit, token_unit) in [(0.0, 0.0), (0.5, 0.5), (0.999, 0.999), (0.25, 1.0)] {
        let times = SendTimes::draw(received, window, expires, send_unit, token_unit);
        assert!(
            (1_010_000..=1_020_000).contains(&times.send_ms),
            "{times:?}"
        );
        assert!(
            (received.0..=times.send_ms).contains(&times.token_ms),
            "{times:?}"
        );
    }
    let times = SendTimes::draw(received, window, expires, 0.5, 0.5);
    assert_eq!((times.send_ms, times.token_ms), (1_015_000, 1_007_500));
    // An assignment that expires inside the window: the instant moves before the expiry.
    let soon = Millis(1_000_000 + 12_000);
    let times = SendTimes::draw(received, window, soon, 0.9, 0.5);
    assert_eq!(times.send_ms, soon.0 - EXPIRY_ALLOWANCE.as_millis() as i64);
    // Already expired: now.
    let times = SendTimes::draw(received, window, Millis(0), 0.9, 0.9);
    assert_eq!((times.send_ms, times.token_ms), (received.0, received.0));
}

#[test]
fn the_operating_systems_draws_are_uniform_units() {
    let draws: Vec<f64> = (0..2_000).map(|_| uniform_unit().unwrap()).collect();
    assert!(draws.iter().all(|u| (0.0..1.0).contains(u)));
    let mean = draws.iter().sum::<f64>() / draws.len() as f64;
    // The mean of 2,000 uniform draws has a standard deviation of 0.0065: 8 of them.
    assert!((mean - 0.5).abs() < 0.052, "mean {mean}");
}
