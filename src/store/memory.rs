//! Placeholder: the embedded store lands with issue 2.
