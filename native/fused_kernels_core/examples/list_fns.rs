use fused_kernels_core::kernels::{feature_level, ALL, CI_ARCHS};
fn main() {
    let mut total = 0;
    for arch in CI_ARCHS {
        let n: usize = ALL
            .iter()
            .map(|k| {
                let t = k.target_arch(arch);
                let lvl = if t.ends_with('a') {
                    900
                } else {
                    k.feature_level(arch).unwrap()
                };
                let _ = feature_level(arch);
                k.instances(lvl).len()
            })
            .sum();
        println!("{arch} {n}");
        total += n;
    }
    println!("total {total}");
}
