//! The page shell every console page shares: language, viewport, stylesheet, a skip link, the
//! navigation and the sign-out form of a signed-in tenant.

use maud::{DOCTYPE, Markup, html};

use super::session::Session;

/// A whole page. `refresh` reloads it every so many seconds (a running round), without script.
pub(super) fn page(
    title: &str,
    session: Option<&Session>,
    refresh: Option<u32>,
    main: Markup,
) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                @if let Some(seconds) = refresh {
                    meta http-equiv="refresh" content=(seconds);
                }
                title { (title) " · confed console" }
                link rel="stylesheet" href="/console/console.css";
            }
            body {
                a.skip href="#main" { "Skip to content" }
                header {
                    nav aria-label="Console" {
                        span.brand { "confed" }
                        @if let Some(session) = session {
                            a href="/console/tasks" { "Tasks" }
                            a href="/console/tasks/new" { "New task" }
                            a href="/console/populations" { "Populations" }
                            span.who { "Signed in as " strong { (session.tenant.name) } }
                            form.inline method="post" action="/console/sign-out" {
                                (csrf_field(session))
                                button type="submit" { "Sign out" }
                            }
                        }
                    }
                }
                main #main { (main) }
            }
        }
    }
}

/// The hidden CSRF field every form of a signed-in page carries.
pub(super) fn csrf_field(session: &Session) -> Markup {
    html! { input type="hidden" name="csrf" value=(session.csrf); }
}

/// A number with thousands separators, for counts a partner reads at a glance.
pub(super) fn count(value: i64) -> String {
    let digits = value.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if value < 0 { format!("-{out}") } else { out }
}

/// A duration in milliseconds as "35 ms", "1.2 s", "3 min 4 s" or "2 h 5 min".
pub(super) fn duration(millis: i64) -> String {
    let seconds = millis as f64 / 1000.0;
    if millis < 1000 {
        format!("{millis} ms")
    } else if seconds < 60.0 {
        format!("{seconds:.1} s")
    } else if seconds < 3600.0 {
        format!(
            "{} min {} s",
            (seconds / 60.0) as i64,
            (seconds % 60.0) as i64
        )
    } else {
        format!(
            "{} h {} min",
            (seconds / 3600.0) as i64,
            ((seconds % 3600.0) / 60.0) as i64
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_durations_read_naturally() {
        assert_eq!(count(0), "0");
        assert_eq!(count(999), "999");
        assert_eq!(count(1000), "1,000");
        assert_eq!(count(1234567), "1,234,567");
        assert_eq!(duration(35), "35 ms");
        assert_eq!(duration(1500), "1.5 s");
        assert_eq!(duration(125_000), "2 min 5 s");
        assert_eq!(duration(7_500_000), "2 h 5 min");
    }
}
