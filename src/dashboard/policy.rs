//! Which requests the dashboard answers: a pure decision from what a request shows (its
//! method, path, `Host`, `Origin` and credentials), with a table test. No option turns
//! any of it off.
//!
//! - `Host` must name the dashboard: a loopback name, the address it is bound to, or a
//!   name the user configured (`cluster.dashboard_hosts`). This is what stops DNS
//!   rebinding, where a page of another site reaches the loopback port under its own
//!   name.
//! - A request that is not `GET` or `HEAD` must come from the same origin (its `Origin`
//!   names the same host and port as `Host`); one other than the login must also carry
//!   the session's CSRF token.
//! - Pages and the API need a session (the cookie the login sets, or the dashboard's
//!   token as a bearer token); `/metrics` takes the read-only metrics token as well.
//! - The one action, cancelling a job (`POST job/NAME/cancel`), is refused unless the
//!   head was started with `--dashboard-actions`.

use axum::http::Method;

/// What a path needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Class {
    /// The page (a login shell without a session), its script and style, the login.
    Public,
    /// `/metrics`: a session or the metrics token.
    Metrics,
    /// `job/NAME/cancel`: a session, with actions on.
    Action,
    /// Everything else: a session.
    Session,
}

/// The class of `path`.
pub(super) fn class(path: &str) -> Class {
    match path {
        "/" | "/app.js" | "/style.css" | "/login" => Class::Public,
        "/metrics" => Class::Metrics,
        _ if path.starts_with("/job/") && path.ends_with("/cancel") => Class::Action,
        _ => Class::Session,
    }
}

/// Who a request proved to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Credential {
    None,
    /// A live session (by cookie or the dashboard token); `csrf_ok` when the request also
    /// carried that session's CSRF token.
    Session {
        csrf_ok: bool,
    },
    /// The read-only metrics token.
    Metrics,
}

/// A request as the policy sees it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Seen<'a> {
    pub method: &'a Method,
    pub path: &'a str,
    pub host: Option<&'a str>,
    pub origin: Option<&'a str>,
    pub credential: Credential,
}

/// Why a request is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(super) enum Refusal {
    #[error("this dashboard does not answer to that Host")]
    Host,
    #[error("a request that changes something must come from the dashboard's own page")]
    CrossOrigin,
    #[error("missing or wrong CSRF token")]
    Csrf,
    #[error("open the URL `imgrun start --head` printed: it carries the token")]
    Unauthenticated,
    #[error(
        "this dashboard is read-only: start the head with --dashboard-actions to cancel jobs from it"
    )]
    ActionsOff,
}

/// The names (lower case, without port) the dashboard answers to.
#[derive(Debug, Clone)]
pub(super) struct Hosts(Vec<String>);

impl Hosts {
    /// The loopback names, `bound` (the address it listens on) and `extra`.
    pub(super) fn new(bound: std::net::IpAddr, extra: &[String]) -> Self {
        let mut names: Vec<String> = ["localhost", "127.0.0.1", "::1"]
            .into_iter()
            .map(str::to_owned)
            .collect();
        names.push(bound.to_string());
        names.extend(extra.iter().map(|name| name.to_ascii_lowercase()));
        names.sort();
        names.dedup();
        Hosts(names)
    }

    fn allows(&self, host: &str) -> bool {
        let name = host_name(host).to_ascii_lowercase();
        self.0.contains(&name)
    }
}

/// The name of a `Host` value: without its port, an IPv6 address without brackets.
fn host_name(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
}

/// Whether `request` may be answered; `actions`: whether the head was started with
/// `--dashboard-actions`.
pub(super) fn check(hosts: &Hosts, actions: bool, request: &Seen<'_>) -> Result<(), Refusal> {
    let host = request.host.ok_or(Refusal::Host)?;
    if !hosts.allows(host) {
        return Err(Refusal::Host);
    }
    let reads = matches!(*request.method, Method::GET | Method::HEAD);
    if !reads {
        // Same origin: `Origin` is `scheme://host[:port]` of the page that sent it.
        let same = request
            .origin
            .and_then(|origin| origin.split_once("://"))
            .is_some_and(|(_, authority)| authority.eq_ignore_ascii_case(host));
        if !same {
            return Err(Refusal::CrossOrigin);
        }
    }
    let class = class(request.path);
    match (class, request.credential) {
        (Class::Public, _) if reads || request.path == "/login" => Ok(()),
        (Class::Metrics, Credential::Metrics) if reads => Ok(()),
        (_, Credential::Session { csrf_ok }) => {
            if !reads && !csrf_ok {
                Err(Refusal::Csrf)
            } else if class == Class::Action && !actions {
                Err(Refusal::ActionsOff)
            } else {
                Ok(())
            }
        }
        _ => Err(Refusal::Unauthenticated),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Method, path, `Host`, `Origin`, credential, and the decision.
    type Row<'a> = (
        &'a Method,
        &'a str,
        Option<&'a str>,
        Option<&'a str>,
        Credential,
        Result<(), Refusal>,
    );

    #[test]
    fn requests_are_answered_only_with_the_right_host_origin_and_credential() {
        use Credential::{Metrics, None as Nobody, Session};
        let hosts = Hosts::new(
            "127.0.0.1".parse().expect("an address"),
            &["dash.example".to_owned()],
        );
        let session = Session { csrf_ok: false };
        let get = Method::GET;
        let post = Method::POST;
        let here = Some("127.0.0.1:7080");
        let from_here = Some("http://127.0.0.1:7080");
        #[rustfmt::skip]
        let table: [Row; 22] = [
            // The login shell and its files need nothing but a right Host.
            (&get, "/", here, None, Nobody, Ok(())),
            (&get, "/app.js", Some("localhost:7080"), None, Nobody, Ok(())),
            (&get, "/", Some("[::1]:7080"), None, Nobody, Ok(())),
            (&get, "/", Some("DASH.example"), None, Nobody, Ok(())),
            // DNS rebinding: another name, even with a session.
            (&get, "/", Some("evil.example:7080"), None, session, Err(Refusal::Host)),
            (&get, "/api/state", Some("evil.example"), None, session, Err(Refusal::Host)),
            (&get, "/api/state", None, None, session, Err(Refusal::Host)),
            (&get, "/api/state", Some("127.0.0.1.evil.example"), None, session, Err(Refusal::Host)),
            // Pages and the API need a session.
            (&get, "/api/state", here, None, Nobody, Err(Refusal::Unauthenticated)),
            (&get, "/job/a", here, None, Nobody, Err(Refusal::Unauthenticated)),
            (&get, "/api/state", here, None, Metrics, Err(Refusal::Unauthenticated)),
            (&get, "/api/state", here, None, session, Ok(())),
            (&get, "/job/a", here, None, session, Ok(())),
            // /metrics takes the metrics token or a session.
            (&get, "/metrics", here, None, Nobody, Err(Refusal::Unauthenticated)),
            (&get, "/metrics", here, None, Metrics, Ok(())),
            (&get, "/metrics", here, None, session, Ok(())),
            // A login from the page itself, never from another site or without Origin.
            (&post, "/login", here, from_here, Nobody, Ok(())),
            (&post, "/login", here, Some("http://evil.example"), Nobody, Err(Refusal::CrossOrigin)),
            (&post, "/login", here, None, Nobody, Err(Refusal::CrossOrigin)),
            // Anything else that changes something needs the CSRF token too.
            (&post, "/api/cancel", here, from_here, session, Err(Refusal::Csrf)),
            (&post, "/api/cancel", here, from_here, Session { csrf_ok: true }, Ok(())),
            (&post, "/metrics", here, from_here, Metrics, Err(Refusal::Unauthenticated)),
        ];
        let decide = |actions: bool, (method, path, host, origin, credential, expected): Row| {
            let seen = Seen {
                method,
                path,
                host,
                origin,
                credential,
            };
            assert_eq!(
                check(&hosts, actions, &seen),
                expected,
                "actions {actions}: {seen:?}"
            );
        };
        for row in table {
            // Actions change nothing of these.
            decide(false, row);
            decide(true, row);
        }
        // Cancelling a job: only with actions on, and as any other change.
        let cancel = "/job/a/cancel";
        let csrf = Session { csrf_ok: true };
        #[rustfmt::skip]
        let actions: [(bool, Row); 6] = [
            (false, (&post, cancel, here, from_here, csrf, Err(Refusal::ActionsOff))),
            (true, (&post, cancel, here, from_here, csrf, Ok(()))),
            (true, (&post, cancel, here, from_here, session, Err(Refusal::Csrf))),
            (true, (&post, cancel, here, Some("http://evil.example"), csrf, Err(Refusal::CrossOrigin))),
            (true, (&post, cancel, here, from_here, Nobody, Err(Refusal::Unauthenticated))),
            (true, (&post, cancel, here, from_here, Metrics, Err(Refusal::Unauthenticated))),
        ];
        for (on, row) in actions {
            decide(on, row);
        }
    }

    #[test]
    fn a_host_value_is_its_name_without_the_port() {
        for (host, name) in [
            ("127.0.0.1:7080", "127.0.0.1"),
            ("localhost", "localhost"),
            ("[::1]:80", "::1"),
            ("[::1]", "::1"),
            ("a.b:x", "a.b:x"),
        ] {
            assert_eq!(host_name(host), name, "{host}");
        }
    }
}
