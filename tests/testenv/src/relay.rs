//! A TCP relay from 127.0.0.1 in the host's network namespace into the test world: how people
//! (and `make demo`) reach the API server and a Service's pods without the world ever adding an
//! address to the host. The listening socket is created in the host's namespace; connections to
//! the target are made from the world's.

use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;

use crate::netns;

/// Where a new connection should go; asked once per connection (a Service's ready endpoint may
/// change between connections).
pub type Target = Arc<dyn Fn() -> io::Result<SocketAddr> + Send + Sync>;

#[derive(Debug)]
pub struct Relay {
    /// The host-side address: 127.0.0.1 and `port` (or a free port when 0 was asked for).
    pub addr: SocketAddr,
}

impl Relay {
    /// Listens on 127.0.0.1:`port` in the host's namespace and relays every connection to
    /// `target` until the process exits.
    pub fn start(port: u16, target: Target) -> anyhow::Result<Relay> {
        let listener = netns::in_host(move || TcpListener::bind(("127.0.0.1", port)))??;
        let addr = listener.local_addr()?;
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let target = target.clone();
                std::thread::spawn(move || {
                    if let Err(e) = relay(client, &*target) {
                        tracing::debug!(error = %e, "relayed connection ended");
                    }
                });
            }
        });
        Ok(Relay { addr })
    }
}

fn relay(client: TcpStream, target: &(dyn Fn() -> io::Result<SocketAddr> + Send + Sync)) -> io::Result<()> {
    let upstream = TcpStream::connect(target()?)?;
    let (mut client_r, mut upstream_w) = (client.try_clone()?, upstream.try_clone()?);
    let forward = std::thread::spawn(move || {
        let _ = io::copy(&mut client_r, &mut upstream_w);
        let _ = upstream_w.shutdown(Shutdown::Write);
    });
    let (mut upstream_r, mut client_w) = (upstream, client);
    let _ = io::copy(&mut upstream_r, &mut client_w);
    let _ = client_w.shutdown(Shutdown::Write);
    let _ = forward.join();
    Ok(())
}
