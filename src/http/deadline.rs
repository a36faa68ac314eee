//! The backstop on a request: how long one may take in all, and what it is told past that.

use std::time::Duration;

use super::error::ApiError;
use crate::app::App;

/// A backstop on any one request, beyond the write loop's own deadline.
pub const REQUEST_DEADLINE_MARGIN: Duration = Duration::from_secs(5);

/// How long a request may take: the write deadline and a margin.
pub fn request_deadline(app: &App) -> Duration {
    app.config.write().deadline + REQUEST_DEADLINE_MARGIN
}

/// The backstop's answer: nothing is known to have been done, so retry.
pub fn took_too_long() -> ApiError {
    ApiError::Unavailable("the request took too long; retry it".into())
}
