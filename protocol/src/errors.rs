//! Errors keep their cause (`#[source]`) rather than its text; where one must become a line of
//! text (a log field, a report to the server, a failure recorded for later), it is written with
//! its causes.

/// `error` and each of its causes, joined by `: ` (`cannot reach X: connection refused`).
pub fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(error) = cause {
        text.push_str(": ");
        text.push_str(&error.to_string());
        cause = error.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn causes_follow_the_error_in_order() {
        let error = Outer(std::io::Error::other("inner"));
        assert_eq!(with_causes(&error), "outer: inner");
    }
}
