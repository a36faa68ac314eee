//! The address a request's connection came from. A leaf: the accept loop (`serve`) puts it
//! on the request, and the layers that read it (the access line, the per-peer failure
//! limit) depend on it without depending on the loop that builds their stack.

/// The address a request's connection came from, on the request for the layers (the
/// access line, the per-peer failure limit). The TCP peer: behind a proxy, the proxy's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer(pub std::net::SocketAddr);
