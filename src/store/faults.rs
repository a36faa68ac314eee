//! Placeholder: fault injection lands with issue 2.
