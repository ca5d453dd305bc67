//! A small blocking HTTP/1.1 client for the synchronous tests (control-plane and operator tests
//! talk to pods on plain HTTP from threads without a runtime). The async tests use reqwest.

use std::io::{Read, Write};
use std::time::Duration;

/// `(status, body)` of one request, or `None` when the peer cannot be reached or answers no HTTP.
pub fn request(method: &str, url: &str, body: Option<&str>) -> Option<(u16, String)> {
    request_with(method, url, &[], body)
}

/// The same, with extra request headers (`name`, `value`).
pub fn request_with(method: &str, url: &str, headers: &[(&str, &str)], body: Option<&str>) -> Option<(u16, String)> {
    let rest = url.strip_prefix("http://")?;
    let (host, path) = rest.split_once('/').map(|(h, p)| (h, format!("/{p}"))).unwrap_or((rest, "/".into()));
    let mut s = std::net::TcpStream::connect_timeout(&host.parse().ok()?, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(60))).ok()?;
    let body = body.unwrap_or("");
    let extra: String = headers.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Type: application/json\r\n{extra}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).ok()?;
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(body) } else { body.to_string() };
    Some((status, body))
}

/// The body of a `GET` answered with 200.
pub fn get(url: &str) -> Option<String> {
    request("GET", url, None).filter(|(s, _)| *s == 200).map(|(_, b)| b)
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn chunked_bodies_are_joined() {
        assert_eq!(super::dechunk("5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"), "hello world");
    }
}
