//! Turning flags into a loaded model and a measured pool. Device selection lives here only.

use std::sync::Arc;

use anyhow::{Context, bail};
use candle_core::Device;
use kvgate_proto::CapacityReport;

use crate::cli::EngineArgs;
use crate::kv::sizing::available_host_memory;
use crate::kv::{KvLayout, KvPool};
use crate::model::Model;

/// Where the KV pool lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolDevice {
    Cpu,
    Cuda(usize),
}

impl std::str::FromStr for PoolDevice {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<Self> {
        match s {
            "cpu" => Ok(PoolDevice::Cpu),
            "cuda" => Ok(PoolDevice::Cuda(0)),
            _ => match s.strip_prefix("cuda:").map(str::parse) {
                Some(Ok(n)) => Ok(PoolDevice::Cuda(n)),
                _ => bail!("--device must be cpu, cuda or cuda:N, got `{s}`"),
            },
        }
    }
}

/// A model and the pool sized for it, measured.
#[derive(Debug)]
pub struct Loaded {
    pub model: Arc<Model>,
    pub pool: Arc<KvPool>,
    pub report: CapacityReport,
}

pub fn load(args: &EngineArgs) -> anyhow::Result<Loaded> {
    let kernels = crate::cpu::level::from_env().map_err(anyhow::Error::msg)?;
    tracing::info!(
        kernels = kernels.name(),
        widest = crate::cpu::level::widest().name(),
        threads = rayon::current_num_threads(),
        page_tags = kvgate_proto::polyval::implementation(),
        "CPU kernels"
    );
    // The model runs on the CPU; only the pool may live on a GPU.
    let model = Model::load(&args.model, &Device::Cpu).with_context(|| format!("loading model {:?}", args.model))?;
    tracing::info!(model = %model.name, fingerprint = %model.fingerprint, weights = %model.llama.weight_types(), "model loaded");
    let layout = model.kv_layout(args.pool.page_size, args.pool.kv_dtype);
    layout.check().map_err(|e| anyhow::anyhow!("--{}: {e}", kvgate_proto::contract::flag::KV_DTYPE))?;
    let size = args.pool.size(args.context_window);
    let pool = match args.pool.device.parse::<PoolDevice>()? {
        PoolDevice::Cpu => {
            let pages = size.pages(&layout, available_host_memory)?;
            // A test fault of the whole process (`testing` builds only).
            #[cfg(feature = "testing")]
            let pages = crate::handoff::restart_fault::pages(pages);
            KvPool::host(layout, pages).context("allocating the KV pool in host memory")?
        }
        PoolDevice::Cuda(ordinal) => cuda_pool(layout, size, ordinal)?,
    };
    if args.pool.no_kv_scrub {
        tracing::warn!("--no-kv-scrub: freed KV pages keep their bytes (still unreadable through the generation check)");
    }
    let pool = if args.pool.no_kv_scrub { pool.without_scrub() } else { pool };
    let report = report(&model, &pool);
    if let Some(path) = &args.pool.report_file {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(Loaded { model: Arc::new(model), pool, report })
}

#[cfg(feature = "cuda")]
fn cuda_pool(layout: KvLayout, size: crate::kv::PoolSize, ordinal: usize) -> anyhow::Result<Arc<KvPool>> {
    let store = crate::kv::cuda_store::CudaStore::allocate(&layout, size, ordinal)?;
    let pages = store.num_pages();
    Ok(KvPool::new(layout, crate::kv::PageStore::cuda(store), pages, format!("cuda:{ordinal}"), true))
}

#[cfg(not(feature = "cuda"))]
fn cuda_pool(_: KvLayout, _: crate::kv::PoolSize, _: usize) -> anyhow::Result<Arc<KvPool>> {
    bail!("--device cuda: this kvgate-worker was built without CUDA support; rebuild with `--features cuda`")
}

pub fn report(model: &Model, pool: &KvPool) -> CapacityReport {
    let layout = pool.layout();
    CapacityReport {
        capacity_tokens: pool.capacity_tokens() as u64,
        page_size: layout.page_size as u32,
        num_pages: pool.num_pages() as u64,
        bytes_per_token: layout.bytes_per_token() as u64,
        device: pool.device().to_string(),
        dtype: layout.dtype.to_string(),
        model: model.name.clone(),
        model_fingerprint: model.fingerprint.clone(),
        layout_fingerprint: layout.fingerprint(),
        vocab_size: Some(model.vocab_size() as u32),
        instance: String::new(),
        prefill_timings: None,
    }
}
