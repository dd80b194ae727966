#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! Scheduling policies compared on a simulated population (`cargo bench --bench scheduling`): many
//! tasks of different demands arrive over time and share one population of devices; the check-in
//! picks among the fitting rounds with the real ordering (`confed::scheduling`), everything else
//! is a model on a virtual clock (no server, no sleeping). Prints, per policy, the mean and p95
//! task completion time (arrival to last round) over several seeds.
//!
//! The model: devices come back after an idle time of 60-120 s (a retry window); an assigned
//! device trains for 30-90 s, then reports; 10 % drop out and their slot frees when the
//! assignment times out (600 s). A round has `ceil(1.3 x report goal)` slots (over-selection),
//! closes at its report goal, aggregates for 5 s, then the next round opens.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use confed::scheduling::{Schedulable, SchedulingPolicy};

/// Population sizes: plenty (policies hardly matter), busy, overloaded.
const POPULATIONS: [usize; 3] = [1500, 300, 200];
const TASKS: usize = 24;
const ARRIVALS_OVER_SECONDS: f64 = 2.0 * 3600.0;
const SEEDS: u64 = 5;
const AGGREGATION_SECONDS: f64 = 5.0;
const TIMEOUT_SECONDS: f64 = 600.0;
const DROPOUT: f64 = 0.1;

/// SplitMix64: small, seeded, good enough for a simulation.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn uniform(&mut self, low: f64, high: f64) -> f64 {
        low + (high - low) * (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[(self.next() % items.len() as u64) as usize]
    }
}

struct Task {
    id: String,
    arrival: f64,
    rounds: u32,
    goal: u32,
    round: u32,
    /// Assignments out (training) plus completed reports of the live round.
    live: u32,
    completed: u32,
    /// Whether the live round takes devices (false while it aggregates, or before arrival).
    collecting: bool,
    done_at: Option<f64>,
}

impl Task {
    fn capacity(&self) -> u32 {
        (f64::from(self.goal) * 1.3).ceil() as u32
    }
}

/// A task's live round as the policies see it.
struct View<'a>(&'a Task, usize);

impl Schedulable for View<'_> {
    fn fill(&self) -> f64 {
        f64::from(self.0.live) / f64::from(self.0.capacity())
    }
    fn deadline_at(&self) -> i64 {
        0 // rounds close at their goal here; the deadline never decides
    }
    fn task_created_at(&self) -> i64 {
        (self.0.arrival * 1000.0) as i64
    }
    fn remaining_demand(&self) -> u64 {
        let rounds_left = u64::from(self.0.rounds - self.0.round + 1);
        (rounds_left * u64::from(self.0.goal))
            .saturating_sub(u64::from(self.0.live.min(self.0.goal)))
    }
    fn task_id(&self) -> &str {
        &self.0.id
    }
}

#[derive(PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// Device checks in.
    CheckIn(usize),
    /// A device's report for (task, round) arrives.
    Report(usize, usize, u32),
    /// A dropped-out device's assignment times out.
    Timeout(usize, u32),
    /// A task's round finished aggregating.
    Aggregated(usize),
    /// A task arrives (its model is uploaded).
    Arrive(usize),
}

struct Clock(f64);

/// Completion times (seconds) of every task, for one policy and seed.
fn simulate(policy: SchedulingPolicy, devices: usize, seed: u64) -> Vec<f64> {
    let mut rng = Rng(seed);
    let mut tasks: Vec<Task> = (0..TASKS)
        .map(|i| Task {
            id: format!("task-{i:02}"),
            arrival: rng.uniform(0.0, ARRIVALS_OVER_SECONDS),
            rounds: rng.pick(&[1, 2, 5, 10]),
            goal: rng.pick(&[20, 50, 100, 200]),
            round: 1,
            live: 0,
            completed: 0,
            collecting: false,
            done_at: None,
        })
        .collect();
    // Events ordered by time (in milliseconds, so the heap's order is total).
    let mut queue: BinaryHeap<Reverse<(u64, Event)>> = BinaryHeap::new();
    let at = |t: f64| (t * 1000.0) as u64;
    for (i, task) in tasks.iter().enumerate() {
        queue.push(Reverse((at(task.arrival), Event::Arrive(i))));
    }
    for device in 0..devices {
        queue.push(Reverse((
            at(rng.uniform(0.0, 120.0)),
            Event::CheckIn(device),
        )));
    }
    let mut clock = Clock(0.0);
    while let Some(Reverse((millis, event))) = queue.pop() {
        clock.0 = millis as f64 / 1000.0;
        let now = clock.0;
        if tasks.iter().all(|t| t.done_at.is_some()) {
            break;
        }
        match event {
            Event::Arrive(i) => tasks[i].collecting = true,
            Event::CheckIn(device) => {
                let mut open: Vec<View> = tasks
                    .iter()
                    .enumerate()
                    .filter(|(_, t)| t.collecting && t.live < t.capacity())
                    .map(|(i, t)| View(t, i))
                    .collect();
                policy.order(&mut open);
                let chosen = open.first().map(|v| v.1);
                match chosen {
                    Some(i) => {
                        let task = &mut tasks[i];
                        task.live += 1;
                        if rng.uniform(0.0, 1.0) < DROPOUT {
                            queue.push(Reverse((
                                at(now + TIMEOUT_SECONDS),
                                Event::Timeout(i, task.round),
                            )));
                            queue.push(Reverse((
                                at(now + rng.uniform(60.0, 120.0)),
                                Event::CheckIn(device),
                            )));
                        } else {
                            queue.push(Reverse((
                                at(now + rng.uniform(30.0, 90.0)),
                                Event::Report(device, i, task.round),
                            )));
                        }
                    }
                    None => queue.push(Reverse((
                        at(now + rng.uniform(60.0, 120.0)),
                        Event::CheckIn(device),
                    ))),
                }
            }
            Event::Report(device, i, round) => {
                let task = &mut tasks[i];
                if task.round == round && task.collecting {
                    task.completed += 1;
                    if task.completed >= task.goal {
                        task.collecting = false;
                        queue.push(Reverse((
                            at(now + AGGREGATION_SECONDS),
                            Event::Aggregated(i),
                        )));
                    }
                }
                queue.push(Reverse((
                    at(now + rng.uniform(60.0, 120.0)),
                    Event::CheckIn(device),
                )));
            }
            Event::Timeout(i, round) => {
                let task = &mut tasks[i];
                if task.round == round && task.collecting {
                    task.live -= 1;
                }
            }
            Event::Aggregated(i) => {
                let task = &mut tasks[i];
                if task.round == task.rounds {
                    task.done_at = Some(now);
                } else {
                    task.round += 1;
                    task.live = 0;
                    task.completed = 0;
                    task.collecting = true;
                }
            }
        }
    }
    tasks
        .iter()
        .map(|t| t.done_at.unwrap_or(clock.0) - t.arrival)
        .collect()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

fn main() {
    println!(
        "scheduling: {TASKS} tasks (rounds 1/2/5/10 x report goal 20/50/100/200) arriving over {:.0} h, {SEEDS} seeds; task completion time (arrival to last round)",
        ARRIVALS_OVER_SECONDS / 3600.0
    );
    for devices in POPULATIONS {
        println!(
            "\n{devices} devices\n{:<28} {:>12} {:>12} {:>12}",
            "policy", "mean (min)", "p95 (min)", "max (min)"
        );
        for policy in [
            SchedulingPolicy::FairShare,
            SchedulingPolicy::FirstComeFirstServed,
            SchedulingPolicy::ShortestRemainingDemand,
        ] {
            let mut times: Vec<f64> = (1..=SEEDS)
                .flat_map(|seed| simulate(policy, devices, seed))
                .collect();
            times.sort_by(f64::total_cmp);
            let mean = times.iter().sum::<f64>() / times.len() as f64;
            println!(
                "{:<28} {:>12.1} {:>12.1} {:>12.1}",
                format!("{policy:?}"),
                mean / 60.0,
                percentile(&times, 0.95) / 60.0,
                times.last().copied().unwrap_or(0.0) / 60.0
            );
        }
    }
}
