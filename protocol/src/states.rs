//! The names of the persisted states a client sees (task, round and assignment states in API
//! answers). Which transitions are allowed is the server's business (`confed::states`).

use serde::{Deserialize, Serialize};

/// Task: CREATED -> OPEN -> COMPLETED | FAILED | CANCELLED (a task that never got a model may be
/// cancelled from CREATED).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum TaskState {
    Created,
    Open,
    Completed,
    Failed,
    Cancelled,
}

impl TaskState {
    /// Every state, in the order of the machine.
    pub const ALL: &'static [Self] = &[
        Self::Created,
        Self::Open,
        Self::Completed,
        Self::Failed,
        Self::Cancelled,
    ];

    /// The name stored and sent on the wire.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Created => "CREATED",
            Self::Open => "OPEN",
            Self::Completed => "COMPLETED",
            Self::Failed => "FAILED",
            Self::Cancelled => "CANCELLED",
        }
    }
}

/// Round: COLLECTING -> AGGREGATING -> APPLYING -> COMPLETED, and FAILED from any live state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum RoundState {
    Collecting,
    Aggregating,
    Applying,
    Completed,
    Failed,
}

impl RoundState {
    /// Every state, in the order of the machine.
    pub const ALL: &'static [Self] = &[
        Self::Collecting,
        Self::Aggregating,
        Self::Applying,
        Self::Completed,
        Self::Failed,
    ];

    /// The name stored and sent on the wire.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Collecting => "COLLECTING",
            Self::Aggregating => "AGGREGATING",
            Self::Applying => "APPLYING",
            Self::Completed => "COMPLETED",
            Self::Failed => "FAILED",
        }
    }
}

/// Assignment: ASSIGNED -> UPLOADED -> COMPLETED, or FAILED / TIMED_OUT / REJECTED before
/// completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum AssignmentState {
    Assigned,
    Uploaded,
    Completed,
    Failed,
    TimedOut,
    Rejected,
}

impl AssignmentState {
    /// Every state, in the order of the machine.
    pub const ALL: &'static [Self] = &[
        Self::Assigned,
        Self::Uploaded,
        Self::Completed,
        Self::Failed,
        Self::TimedOut,
        Self::Rejected,
    ];

    /// The name stored and sent on the wire.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Assigned => "ASSIGNED",
            Self::Uploaded => "UPLOADED",
            Self::Completed => "COMPLETED",
            Self::Failed => "FAILED",
            Self::TimedOut => "TIMED_OUT",
            Self::Rejected => "REJECTED",
        }
    }
}
