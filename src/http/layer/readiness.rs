//! A replica that has not finished starting answers the API 503 (naming the steps it waits
//! for): until it is anchored to the server's clock, the fold cannot age the recent-writes
//! index, and until the demo accounts are seeded a write could take their first version.
//! The store is needed for either, so the client retries shortly. Probes, scrapes and the
//! console are served meanwhile (`/readyz` says `starting` itself).

use std::sync::Arc;

use super::check::Check;
use crate::app::App;
use crate::http::error::ApiError;
use crate::http::router::Routed;

/// The API waits for start-up; the rest is served meanwhile.
#[derive(Clone)]
pub struct Started {
    app: Arc<App>,
}

impl Started {
    pub fn new(app: Arc<App>) -> Self {
        Started { app }
    }
}

impl Check for Started {
    fn check(&self, routed: &mut Routed) -> Result<(), ApiError> {
        if routed.route().is_some_and(|r| r.is_api()) && !self.app.is_started() {
            return Err(ApiError::starting(&self.app.startup_waiting()));
        }
        Ok(())
    }
}
