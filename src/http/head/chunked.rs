//! A chunked body's framing (RFC 9112, 7.1), followed byte by byte as strictly as hyper
//! decodes it, so the scan knows where the next head starts.

/// A chunked body's framing (RFC 9112, 7.1), as strictly as hyper decodes it.
#[derive(Clone, Copy)]
pub(super) enum Chunk {
    Start,
    Size(u64),
    SizeSpace(u64),
    Extension(u64),
    SizeLf(u64),
    Data(u64),
    DataCr,
    DataLf,
    /// After the last chunk: the end, or a trailer field.
    EndCr,
    Trailer,
    TrailerLf,
    EndLf,
}

/// What one byte of a chunked body did.
pub(super) enum ChunkStep {
    Next(Chunk),
    End,
    Lost,
}
/// Reads chunked-body bytes from `chunk`: how many were used, and the step they ended on.
pub(super) fn chunk_bytes(mut chunk: Chunk, bytes: &[u8]) -> (usize, ChunkStep) {
    let mut i = 0;
    while i < bytes.len() {
        if let Chunk::Data(left) = chunk {
            let n = usize::try_from(left).map_or(bytes.len() - i, |l| l.min(bytes.len() - i));
            let left = left - n as u64;
            chunk = if left == 0 {
                Chunk::DataCr
            } else {
                Chunk::Data(left)
            };
            i += n;
            continue;
        }
        let step = chunk_byte(chunk, bytes[i]);
        i += 1;
        match step {
            ChunkStep::Next(next) => chunk = next,
            end => return (i, end),
        }
    }
    (i, ChunkStep::Next(chunk))
}

fn hex(b: u8) -> Option<u64> {
    (b as char).to_digit(16).map(u64::from)
}

fn chunk_byte(chunk: Chunk, b: u8) -> ChunkStep {
    use ChunkStep::{End, Lost, Next};
    let grow = |size: u64, d: u64| size.checked_mul(16).and_then(|s| s.checked_add(d));
    match (chunk, b) {
        (Chunk::Start, _) => hex(b).map_or(Lost, |d| Next(Chunk::Size(d))),
        (Chunk::Size(size), _) if hex(b).is_some() => {
            grow(size, hex(b).unwrap_or_default()).map_or(Lost, |s| Next(Chunk::Size(s)))
        }
        (Chunk::Size(size) | Chunk::SizeSpace(size), b' ' | b'\t') => Next(Chunk::SizeSpace(size)),
        (Chunk::Size(size) | Chunk::SizeSpace(size), b';') => Next(Chunk::Extension(size)),
        (Chunk::Size(size) | Chunk::SizeSpace(size) | Chunk::Extension(size), b'\r') => {
            Next(Chunk::SizeLf(size))
        }
        (Chunk::Extension(_), b'\n') => Lost,
        (Chunk::Extension(size), _) => Next(Chunk::Extension(size)),
        (Chunk::SizeLf(0), b'\n') => Next(Chunk::EndCr),
        (Chunk::SizeLf(size), b'\n') => Next(Chunk::Data(size)),
        (Chunk::DataCr, b'\r') => Next(Chunk::DataLf),
        (Chunk::DataLf, b'\n') => Next(Chunk::Start),
        (Chunk::EndCr, b'\r') => Next(Chunk::EndLf),
        (Chunk::Trailer, b'\r') => Next(Chunk::TrailerLf),
        (Chunk::EndCr | Chunk::Trailer, _) => Next(Chunk::Trailer),
        (Chunk::TrailerLf, b'\n') => Next(Chunk::EndCr),
        (Chunk::EndLf, b'\n') => End,
        _ => Lost,
    }
}
