//! Who is calling, before anything else about the request is looked at (its body is not
//! read yet, nothing is written): with `--auth jwt`, the caller's token against what the
//! route asks ([`Route::access`](crate::http::router::Route::access), checked by
//! [`auth::check`]), and the caller paced. An admitted caller rides on the request, where
//! the handlers find it (for its own idempotency keys and the accounts a body names).

use std::sync::Arc;

use super::check::Check;
use crate::app::App;
use crate::http::auth;
use crate::http::error::ApiError;
use crate::http::peer::Peer;
use crate::http::router::Routed;
use crate::request_note::RequestNote;

/// The caller's token against what the route asks; the admitted caller rides on the request.
#[derive(Clone)]
pub struct Authenticate {
    app: Arc<App>,
}

impl Authenticate {
    pub fn new(app: Arc<App>) -> Self {
        Authenticate { app }
    }
}

impl Check for Authenticate {
    fn check(&self, routed: &mut Routed) -> Result<(), ApiError> {
        // A request without a route is refused as such, whoever sends it.
        let peer = routed.req.extensions().get::<Peer>().map(|p| p.0.ip());
        if let Some(route) = routed.route()
            && let Some(caller) =
                auth::check(&self.app, route.access(), routed.req.headers(), peer)?
        {
            // The access line names who asked (never the token).
            RequestNote::caller(|| caller.id.clone());
            routed.req.extensions_mut().insert(caller);
        }
        Ok(())
    }
}
