//! The ceiling for Tally's HTTP path: a hyper HTTP/1 server that does nothing but read the
//! request body and answer a small JSON 200, on the same runtime and allocator Tally uses (a
//! multi-threaded tokio runtime with a worker per core, mimalloc, keep-alive connections).
//! Tally's requests per second over this server's, under the same load in the same sitting,
//! says how much of a core Tally's own request path costs beside what any hyper server pays.
//!
//! ```sh
//! cargo run --release --example null_server -- 127.0.0.1:8081
//! scripts/bench/http-path.sh     # this server and Tally under the same wrk load, alternating
//! ```

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The same body limit Tally's edge applies, so a request is read in full as Tally reads it.
const MAX_BODY_BYTES: usize = 64 * 1024;
/// About the size of a deposit's answer.
const ANSWER: &[u8] =
    br#"{"accountId":"00000000-0000-0000-0000-000000000000","balanceCents":"100"}"#;

async fn answer(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let status = match Limited::new(req.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
    {
        Ok(_) => StatusCode::OK,
        Err(_) => StatusCode::PAYLOAD_TOO_LARGE,
    };
    let mut response = Response::new(Full::new(Bytes::from_static(ANSWER)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    Ok(response)
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let address: SocketAddr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:8081".into())
        .parse()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let listener = TcpListener::bind(address).await?;
    eprintln!("null_server listening on {address}");
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        tokio::spawn(async move {
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service_fn(answer))
                .await;
        });
    }
}
