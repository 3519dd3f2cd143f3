//! Where and how the dashboard listens, decided before it binds: plain HTTP on loopback
//! only; on any other address HTTPS, with a certificate of the cluster CA for the names
//! clients reach it by. No option serves plain HTTP off loopback.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use runtime::SubjectAltName;

/// How the dashboard speaks on its socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Scheme {
    Http,
    Https,
}

impl Scheme {
    fn as_str(self) -> &'static str {
        match self {
            Scheme::Http => "http",
            Scheme::Https => "https",
        }
    }
}

/// Why the dashboard refuses to listen where it was asked to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum ListenRefusal {
    #[error(
        "the dashboard binds {bind}, which is not loopback, only with TLS (a certificate of \
         the cluster CA); none was given"
    )]
    NoTls { bind: IpAddr },
    #[error(
        "the dashboard binds every address ({bind}) only with the names users reach it by: \
         set cluster.dashboard_hosts (they go into its certificate and are the only \
         `Host`s it answers besides loopback)"
    )]
    NoHostNames { bind: IpAddr },
}

/// Whether a dashboard bound to `bind` needs TLS: every address but loopback does.
pub fn needs_tls(bind: IpAddr) -> bool {
    !bind.is_loopback()
}

/// How a dashboard on `bind`, answering to `hosts`, listens, given whether it has TLS.
pub(super) fn scheme(bind: IpAddr, hosts: &[String], tls: bool) -> Result<Scheme, ListenRefusal> {
    if !needs_tls(bind) {
        return Ok(Scheme::Http);
    }
    if !tls {
        return Err(ListenRefusal::NoTls { bind });
    }
    if bind.is_unspecified() && hosts.is_empty() {
        return Err(ListenRefusal::NoHostNames { bind });
    }
    Ok(Scheme::Https)
}

/// The names the dashboard's certificate holds: the loopback names (for `ssh -L`), the
/// address it binds unless that is every address, and the host names it answers to
/// (addresses among them as addresses).
pub fn certificate_names(bind: IpAddr, hosts: &[String]) -> Vec<SubjectAltName> {
    let mut names = vec![
        SubjectAltName::Dns("localhost".to_owned()),
        SubjectAltName::Ip(IpAddr::V4(Ipv4Addr::LOCALHOST)),
        SubjectAltName::Ip(IpAddr::V6(Ipv6Addr::LOCALHOST)),
    ];
    if !bind.is_unspecified() && !bind.is_loopback() {
        names.push(SubjectAltName::Ip(bind));
    }
    for host in hosts {
        let name = match host.trim_matches(['[', ']']).parse::<IpAddr>() {
            Ok(ip) => SubjectAltName::Ip(ip),
            Err(_) => SubjectAltName::Dns(host.clone()),
        };
        if !names.contains(&name) {
            names.push(name);
        }
    }
    names
}

/// The URL the head prints: the bound address, or, bound to every address, the first
/// host name it answers to.
pub(super) fn url(scheme: Scheme, addr: SocketAddr, hosts: &[String]) -> String {
    let host = match hosts.first() {
        Some(name) if addr.ip().is_unspecified() => name.clone(),
        _ => match addr.ip() {
            IpAddr::V6(ip) => format!("[{ip}]"),
            IpAddr::V4(ip) => ip.to_string(),
        },
    };
    format!("{}://{host}:{}/", scheme.as_str(), addr.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().expect("ip")
    }

    #[test]
    fn only_loopback_is_served_without_tls() {
        let dash = vec!["dash.example".to_owned()];
        let none: Vec<String> = Vec::new();
        // Bind, hosts, whether TLS is given, and the decision.
        type Case<'a> = (&'a str, &'a [String], bool, Result<Scheme, ListenRefusal>);
        let cases: [Case; 8] = [
            ("127.0.0.1", &none, false, Ok(Scheme::Http)),
            ("::1", &none, false, Ok(Scheme::Http)),
            // TLS given for loopback changes nothing: `ssh -L` reaches plain HTTP.
            ("127.0.0.1", &none, true, Ok(Scheme::Http)),
            (
                "10.0.0.5",
                &none,
                false,
                Err(ListenRefusal::NoTls {
                    bind: ip("10.0.0.5"),
                }),
            ),
            ("10.0.0.5", &none, true, Ok(Scheme::Https)),
            (
                "0.0.0.0",
                &none,
                true,
                Err(ListenRefusal::NoHostNames {
                    bind: ip("0.0.0.0"),
                }),
            ),
            ("0.0.0.0", &dash, true, Ok(Scheme::Https)),
            (
                "::",
                &dash,
                false,
                Err(ListenRefusal::NoTls { bind: ip("::") }),
            ),
        ];
        for (bind, hosts, tls, expected) in cases {
            assert_eq!(scheme(ip(bind), hosts, tls), expected, "{bind} tls={tls}");
        }
    }

    #[test]
    fn the_certificate_names_loopback_the_address_and_the_hosts() {
        let hosts = vec![
            "dash.example".to_owned(),
            "192.168.1.9".to_owned(),
            "[fd00::1]".to_owned(),
            "localhost".to_owned(),
        ];
        let names = certificate_names(ip("10.0.0.5"), &hosts);
        let expected = vec![
            SubjectAltName::Dns("localhost".to_owned()),
            SubjectAltName::Ip(ip("127.0.0.1")),
            SubjectAltName::Ip(ip("::1")),
            SubjectAltName::Ip(ip("10.0.0.5")),
            SubjectAltName::Dns("dash.example".to_owned()),
            SubjectAltName::Ip(ip("192.168.1.9")),
            SubjectAltName::Ip(ip("fd00::1")),
        ];
        assert_eq!(names, expected);
        // Every address adds none of its own.
        assert_eq!(certificate_names(ip("0.0.0.0"), &[]).len(), 3);
    }

    #[test]
    fn the_url_names_what_a_client_can_reach() {
        let hosts = ["dash.example".to_owned()];
        let cases = [
            (
                Scheme::Http,
                "127.0.0.1:7080",
                &[][..],
                "http://127.0.0.1:7080/",
            ),
            (
                Scheme::Https,
                "10.0.0.5:7080",
                &hosts[..],
                "https://10.0.0.5:7080/",
            ),
            (
                Scheme::Https,
                "0.0.0.0:7080",
                &hosts[..],
                "https://dash.example:7080/",
            ),
            (
                Scheme::Https,
                "[fd00::1]:443",
                &[][..],
                "https://[fd00::1]:443/",
            ),
        ];
        for (scheme_, addr, hosts, expected) in cases {
            let addr: SocketAddr = addr.parse().expect("addr");
            assert_eq!(url(scheme_, addr, hosts), expected);
        }
    }
}
