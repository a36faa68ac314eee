//! Reading a header the API takes at most once.

/// A header sent more than once where the API reads one.
pub(crate) struct RepeatedHeader;

/// The value of a header a request may carry at most once (`Idempotency-Key`,
/// `Authorization`, `Content-Type`, `Last-Event-ID`, `Host`): two of them name no one value,
/// and taking the first would act on what the sender may have meant as the other.
pub(crate) fn at_most_one<K: hyper::header::AsHeaderName>(
    headers: &hyper::HeaderMap,
    name: K,
) -> Result<Option<&hyper::header::HeaderValue>, RepeatedHeader> {
    let mut values = headers.get_all(name).iter();
    let first = values.next();
    match values.next() {
        Some(_) => Err(RepeatedHeader),
        None => Ok(first),
    }
}
