//! Unit tests for the Celeriant backend's pure parts, one file per part: how the client's
//! errors map to the port's outcomes (`outcomes.rs`), the configuration (`config_tests.rs`), the
//! translation of filters, pages and batches (`translation.rs`), and the order in which a
//! multi-aggregate write's refusals are restated (`check_order_tests.rs`). The behaviour against a
//! live server is in `tests/store/celeriant.rs`.

use std::io;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use bytes::Bytes;
use celeriant_client_tokio::{
    ClientError, DeleteError, DetailsError, ReadError, ServerError, TrimError, WriteError,
};
use celeriant_crypto::CryptoError;
use celeriant_msg::error_codes as codes;
use celeriant_msg::read_wire_data_error::ReadWireDataError;
use celeriant_msg::response::aggregate_event_batch::AggregateEventBatch;
use celeriant_wire::network::wire_error::WireError;
use clap::Parser;

use super::check_order::*;
use super::classify::*;
use super::config::*;
use super::wire::*;
use super::*;
use crate::store::{Event, EventType};

const ALL_OPS: [Op; 5] = [Op::Read, Op::Details, Op::Ping, Op::Write, Op::Trim];

fn io_err() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionReset, "reset")
}

/// A named constructor for one client error (ClientError is not Clone).
type Case = (&'static str, fn() -> ClientError);

fn is_unknown(e: &StoreError) -> bool {
    matches!(e, StoreError::OutcomeUnknown { .. })
}

fn is_not_applied(e: &StoreError) -> bool {
    matches!(e, StoreError::NotApplied { .. })
}

mod check_order_tests;
mod config_tests;
mod outcomes;
mod translation;
