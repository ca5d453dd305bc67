//! Which instruction set the kernels run with: the widest the CPU offers, or a narrower one named
//! by `KVGATE_CPU_KERNELS` (`avx512`, `avx2` or `portable`) to measure or rule out a path.
//!
//! Every level runs the same source with the same lane layout and no fused multiply-adds, so
//! their results are bit-identical; only the speed differs.

use std::sync::OnceLock;

/// The environment variable that forces a narrower level than the CPU offers.
pub const ENV: &str = "KVGATE_CPU_KERNELS";

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Whatever the target's baseline (SSE2 on x86-64) vectorizes to.
    Portable,
    /// 256-bit vectors: AVX2 with FMA and F16C.
    Avx2,
    /// 512-bit vectors: AVX-512F (with the above).
    Avx512,
}

impl Level {
    pub fn name(self) -> &'static str {
        match self {
            Level::Portable => "portable",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
        }
    }

    fn parse(s: &str) -> Option<Level> {
        [Level::Portable, Level::Avx2, Level::Avx512].into_iter().find(|l| l.name() == s)
    }

    /// Every level this CPU can run, narrowest first.
    pub fn available() -> Vec<Level> {
        [Level::Portable, Level::Avx2, Level::Avx512].into_iter().filter(|l| *l <= widest()).collect()
    }
}

/// The widest level this CPU offers.
pub fn widest() -> Level {
    #[cfg(target_arch = "x86_64")]
    {
        // F16C (half-precision conversion) came with every AVX2 CPU; the half kernels use it.
        let common = std::arch::is_x86_feature_detected!("fma") && std::arch::is_x86_feature_detected!("f16c");
        if std::arch::is_x86_feature_detected!("avx512f") && common {
            return Level::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") && common {
            return Level::Avx2;
        }
    }
    Level::Portable
}

/// The level the kernels run with, decided once: `KVGATE_CPU_KERNELS` when set (never wider
/// than the CPU offers), else the widest.
pub fn level() -> Level {
    static CHOSEN: OnceLock<Level> = OnceLock::new();
    *CHOSEN.get_or_init(|| from_env().unwrap_or_else(|e| panic!("{e}")))
}

/// The level `KVGATE_CPU_KERNELS` asks for; start-up checks it so a bad value is refused there.
pub fn from_env() -> Result<Level, String> {
    choose(std::env::var(ENV).ok().as_deref())
}

/// The level a `KVGATE_CPU_KERNELS` value asks for, or why it cannot be had.
pub fn choose(requested: Option<&str>) -> Result<Level, String> {
    let widest = widest();
    match requested {
        None | Some("") | Some("widest") => Ok(widest),
        Some(s) => match Level::parse(s) {
            Some(l) if l <= widest => Ok(l),
            Some(l) => Err(format!("{ENV}={s}: this CPU offers at most {} ({} needs CPU features it lacks)", widest.name(), l.name())),
            None => Err(format!("{ENV}={s}: expected one of widest, avx512, avx2, portable")),
        },
    }
}

/// Defines `$name` as a function that runs `$body` (an `#[inline(always)]` function with the same
/// parameters) compiled for the chosen level, and `$at` as the same at a level the caller names
/// (one of `Level::available()`; the tests compare the levels with it).
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident / $at:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? => $body:path) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            $at($crate::cpu::level(), $($arg),*)
        }

        #[allow(dead_code, clippy::too_many_arguments)]
        pub(crate) fn $at(level: $crate::cpu::Level, $($arg: $ty),*) $(-> $ret)? {
            assert!(level <= $crate::cpu::level::widest(), "{level:?} is wider than this CPU");
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                fn avx512($($arg: $ty),*) $(-> $ret)? { $body($($arg),*) }
                #[target_feature(enable = "avx2,fma")]
                fn avx2($($arg: $ty),*) $(-> $ret)? { $body($($arg),*) }
                match level {
                    // SAFETY: the CPU reported this level's features (asserted above).
                    $crate::cpu::Level::Avx512 => return unsafe { avx512($($arg),*) },
                    // SAFETY: as above.
                    $crate::cpu::Level::Avx2 => return unsafe { avx2($($arg),*) },
                    $crate::cpu::Level::Portable => {}
                }
            }
            $body($($arg),*)
        }
    };
}
pub(crate) use multiversion;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_level_is_forced_down_never_up_and_a_bad_name_is_named() {
        assert_eq!(choose(None), Ok(widest()));
        assert_eq!(choose(Some("widest")), Ok(widest()));
        assert_eq!(choose(Some("portable")), Ok(Level::Portable));
        if widest() < Level::Avx512 {
            let e = choose(Some("avx512")).unwrap_err();
            assert!(e.contains("KVGATE_CPU_KERNELS=avx512") && e.contains(widest().name()), "{e}");
        }
        let e = choose(Some("sse9")).unwrap_err();
        assert!(e.contains("sse9") && e.contains("avx2"), "{e}");
    }
}
