use fused_kernels_core::cuda::cache;
use fused_kernels_core::kernels::ALL;
fn main() {
    for arch in ["sm_75", "sm_80", "sm_90", "sm_100", "sm_120"] {
        let lvl: i32 = arch[3..].parse::<i32>().unwrap() * 10;
        for k in ALL {
            let mut f = cache::functions(k, arch, None).unwrap();
            let mut t = k.instances(lvl);
            f.sort();
            t.sort();
            if f != t {
                println!(
                    "{arch} {}: ptx-only {:?} table-only {:?}",
                    k.name,
                    f.iter().filter(|x| !t.contains(x)).collect::<Vec<_>>(),
                    t.iter().filter(|x| !f.contains(x)).collect::<Vec<_>>()
                );
            }
        }
    }
    println!("done");
}
