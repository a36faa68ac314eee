//! The HTTP edge's fixed limits, which no flag changes. Its flags are
//! [`crate::config::http`]'s: the configuration sits below the edge.

use std::time::Duration;

/// How long a client may take to send a request's headers.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
