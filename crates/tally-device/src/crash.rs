//! Named crash points. The device's code calls [`Hooks::at`] between every pair of durable
//! steps, so a test can stop it exactly there: the simulation returns [`Crashed`] and drops
//! every piece of in-memory state; the `tally-device` binary, driven by
//! [`CRASH_ENV`], aborts the process on the spot (no destructor, no flush, no rollback but
//! SQLite's own).

use std::fmt;
use std::str::FromStr;

/// The environment variable naming the crash point at which `tally-device` aborts: `STEP`
/// or `STEP@N` (the Nth time the point is reached in this process, 1-based).
pub const CRASH_ENV: &str = "TALLY_DEVICE_CRASH_AT";

/// A point between two durable steps, named by [`CrashPoint::name`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CrashPoint {
    /// Inside the recording transaction, after the sequence is assigned, before commit.
    RecordBeforeCommit,
    /// The event is committed; the operator has not been told yet.
    RecordCommitted,
    /// A run's boundaries are committed; nothing has been sent for this attempt yet.
    RunPersisted,
    /// The server's answer arrived; the run is not marked synced yet.
    Acked,
    /// The run is marked synced; the next run is not taken yet.
    MarkedSynced,
}

impl CrashPoint {
    pub const ALL: [CrashPoint; 5] = [
        CrashPoint::RecordBeforeCommit,
        CrashPoint::RecordCommitted,
        CrashPoint::RunPersisted,
        CrashPoint::Acked,
        CrashPoint::MarkedSynced,
    ];

    pub fn name(self) -> &'static str {
        match self {
            CrashPoint::RecordBeforeCommit => "record-before-commit",
            CrashPoint::RecordCommitted => "record-committed",
            CrashPoint::RunPersisted => "run-persisted",
            CrashPoint::Acked => "acked",
            CrashPoint::MarkedSynced => "marked-synced",
        }
    }
}

impl fmt::Display for CrashPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CrashPoint {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        CrashPoint::ALL
            .into_iter()
            .find(|point| point.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = CrashPoint::ALL.iter().map(|p| p.name()).collect();
                format!("unknown step {s:?} (expected one of {})", names.join(", "))
            })
    }
}

/// The device stopped at a crash point (simulated).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("crashed at {0}")]
pub struct Crashed(pub CrashPoint);

/// Called at every crash point.
pub trait Hooks {
    fn at(&mut self, point: CrashPoint) -> Result<(), Crashed>;
}

/// No crash points: production.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoHooks;

impl Hooks for NoHooks {
    fn at(&mut self, _point: CrashPoint) -> Result<(), Crashed> {
        Ok(())
    }
}

/// Aborts the process at a named crash point: the hook of the `tally-device` binary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AbortAt {
    point: CrashPoint,
    /// Abort when the point is reached this many more times (1 = the next time).
    remaining: u32,
}

impl AbortAt {
    /// Parses `STEP` or `STEP@N` (N >= 1).
    pub fn parse(spec: &str) -> Result<Self, String> {
        let (name, nth) = match spec.split_once('@') {
            Some((name, n)) => {
                let n: u32 = n
                    .parse()
                    .ok()
                    .filter(|&n| n >= 1)
                    .ok_or_else(|| format!("{CRASH_ENV}: {n:?} is not a count >= 1"))?;
                (name, n)
            }
            None => (spec, 1),
        };
        Ok(Self {
            point: name.trim().parse()?,
            remaining: nth,
        })
    }

    /// The hook named by [`CRASH_ENV`], if set.
    pub fn from_env() -> Result<Option<Self>, String> {
        match std::env::var(CRASH_ENV) {
            Ok(spec) if !spec.trim().is_empty() => Self::parse(spec.trim()).map(Some),
            _ => Ok(None),
        }
    }
}

impl Hooks for AbortAt {
    fn at(&mut self, point: CrashPoint) -> Result<(), Crashed> {
        if point == self.point {
            self.remaining -= 1;
            if self.remaining == 0 {
                eprintln!("tally-device: {CRASH_ENV}: aborting at {point}");
                std::process::abort();
            }
        }
        Ok(())
    }
}

impl Hooks for Option<AbortAt> {
    fn at(&mut self, point: CrashPoint) -> Result<(), Crashed> {
        match self {
            Some(hook) => hook.at(point),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crash_specs_name_a_step_and_an_optional_occurrence() {
        assert_eq!(
            AbortAt::parse("acked@3"),
            Ok(AbortAt {
                point: CrashPoint::Acked,
                remaining: 3
            })
        );
        assert_eq!(
            AbortAt::parse("run-persisted").map(|a| a.point),
            Ok(CrashPoint::RunPersisted)
        );
        assert!(AbortAt::parse("acked@0").is_err());
        assert!(AbortAt::parse("nowhere").is_err());
        for point in CrashPoint::ALL {
            assert_eq!(point.name().parse::<CrashPoint>(), Ok(point));
        }
    }
}
