//! Identifying a public request's tenant: a trusted gateway's header when the request comes from
//! the gateway's addresses, else the bearer API key when keys are configured, else the client's
//! address. A missing or unknown key is [`Unauthenticated`] (the API answers 401, see
//! `server::identify`); a request that bypasses the gateway of a gateway-only deployment too.

use kvgate_proto::codes::ErrorCode;
use std::net::IpAddr;
use std::sync::Arc;

use axum::http::{HeaderName, header};
use ipnet::IpNet;

use super::{KeyRing, Tenant, TenantName};

/// A gateway in front of the deployment that authenticates clients itself and names the tenant
/// in a header; believed only from its addresses.
#[derive(Debug, Clone)]
pub struct TrustedProxy {
    pub header: HeaderName,
    pub from: Vec<IpNet>,
}

/// How tenants are proven. Neither set: nobody is authenticated, and the client address is the
/// tenant.
#[derive(Debug, Clone, Default)]
pub struct Auth {
    pub keys: Option<Arc<KeyRing>>,
    pub proxy: Option<TrustedProxy>,
}

/// Why a request has no tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unauthenticated {
    MissingKey,
    UnknownKey,
    /// A gateway-only deployment, called from outside the gateway's addresses.
    NotFromGateway {
        header: String,
    },
    /// The gateway's header is not a tenant name.
    BadTenantHeader {
        header: String,
        why: String,
    },
}

impl Unauthenticated {
    /// The error code and message a client is told.
    pub fn explain(&self) -> (ErrorCode, String) {
        match self {
            Unauthenticated::MissingKey => (ErrorCode::MissingApiKey, "This deployment needs an API key: send it as `Authorization: Bearer KEY`.".to_string()),
            Unauthenticated::UnknownKey => {
                (ErrorCode::InvalidApiKey, "The API key is not one of this deployment's keys (it may have been revoked).".to_string())
            }
            Unauthenticated::NotFromGateway { header } => (
                ErrorCode::NotFromGateway,
                format!("This deployment is served through its gateway only (which names the tenant in `{header}`); this request came from elsewhere."),
            ),
            Unauthenticated::BadTenantHeader { header, why } => {
                (ErrorCode::InvalidTenantHeader, format!("The gateway's `{header}` header is not a tenant name: {why}."))
            }
        }
    }
}

impl Auth {
    /// The tenant `headers` and `addr` prove, or why they prove none.
    pub fn identify(&self, headers: &axum::http::HeaderMap, addr: Option<IpAddr>) -> Result<Tenant, Unauthenticated> {
        if let Some(proxy) = &self.proxy {
            let trusted = addr.is_some_and(|a| proxy.from.iter().any(|net| net.contains(&a)));
            if trusted && let Some(value) = headers.get(&proxy.header) {
                let header = proxy.header.to_string();
                let text = value.to_str().map_err(|_| Unauthenticated::BadTenantHeader { header: header.clone(), why: "not ASCII".into() })?;
                return TenantName::parse(text).map(Tenant::Named).map_err(|why| Unauthenticated::BadTenantHeader { header, why });
            }
            if self.keys.is_none() {
                return Err(Unauthenticated::NotFromGateway { header: proxy.header.to_string() });
            }
        }
        if let Some(ring) = &self.keys {
            let bearer = headers.get(header::AUTHORIZATION).and_then(|h| h.to_str().ok()).and_then(|h| h.strip_prefix("Bearer ")).map(str::trim);
            return match bearer {
                None | Some("") => Err(Unauthenticated::MissingKey),
                Some(key) => ring.current().tenant(key).cloned().map(Tenant::Named).ok_or(Unauthenticated::UnknownKey),
            };
        }
        Ok(addr.map_or(Tenant::Unknown, Tenant::Addr))
    }

    /// Whether any client is authenticated.
    pub fn enabled(&self) -> bool {
        self.keys.is_some() || self.proxy.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::{HeaderMap, HeaderValue};

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        pairs.iter().map(|(k, v)| (HeaderName::from_bytes(k.as_bytes()).unwrap(), HeaderValue::from_str(v).unwrap())).collect()
    }

    fn ring() -> Arc<KeyRing> {
        let dir = std::env::temp_dir().join(format!("kvgate-identify-{}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("acme"), "sk-acme-0123456789abcdef\n").unwrap();
        let ring = KeyRing::open(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        ring
    }

    const CLIENT: Option<IpAddr> = Some(IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 7)));

    #[test]
    fn without_auth_the_address_is_the_tenant_whatever_key_is_sent() {
        let auth = Auth::default();
        let a = auth.identify(&headers(&[("authorization", "Bearer sk-random-1")]), CLIENT).unwrap();
        let b = auth.identify(&headers(&[("authorization", "Bearer sk-random-2")]), CLIENT).unwrap();
        assert_eq!(a, b, "an unverified key is never an identity");
        assert_eq!(a, Tenant::Addr(CLIENT.unwrap()));
    }

    #[test]
    fn with_keys_only_a_known_key_names_a_tenant() {
        let auth = Auth { keys: Some(ring()), proxy: None };
        assert_eq!(auth.identify(&headers(&[("authorization", "Bearer sk-acme-0123456789abcdef")]), CLIENT).unwrap().to_string(), "acme");
        assert_eq!(auth.identify(&headers(&[]), CLIENT).unwrap_err(), Unauthenticated::MissingKey);
        assert_eq!(auth.identify(&headers(&[("authorization", "Bearer sk-guess-0123456789abcd")]), CLIENT).unwrap_err(), Unauthenticated::UnknownKey);
        assert_eq!(Unauthenticated::UnknownKey.explain().0.to_string(), "invalid_api_key");
    }

    #[test]
    fn a_gateways_header_is_believed_from_its_addresses_only() {
        let proxy = TrustedProxy { header: HeaderName::from_static("x-tenant"), from: vec!["10.0.0.0/24".parse().unwrap()] };
        let auth = Auth { keys: None, proxy: Some(proxy.clone()) };
        assert_eq!(auth.identify(&headers(&[("x-tenant", "globex")]), CLIENT).unwrap().to_string(), "globex");
        let outside = Some("192.168.1.5".parse().unwrap());
        assert_eq!(auth.identify(&headers(&[("x-tenant", "globex")]), outside).unwrap_err(), Unauthenticated::NotFromGateway { header: "x-tenant".into() });
        assert!(matches!(auth.identify(&headers(&[("x-tenant", "a b")]), CLIENT), Err(Unauthenticated::BadTenantHeader { .. })));
        // With keys too, a request from elsewhere authenticates with its key.
        let both = Auth { keys: Some(ring()), proxy: Some(proxy) };
        let keyed = headers(&[("x-tenant", "globex"), ("authorization", "Bearer sk-acme-0123456789abcdef")]);
        assert_eq!(both.identify(&keyed, outside).unwrap().to_string(), "acme", "the header from outside the gateway is ignored");
    }
}
