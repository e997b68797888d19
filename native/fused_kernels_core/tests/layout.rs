//! No import circle between the files of any crate: walks the `mod` tree of
//! fused_kernels_core, fused_kernels_nif and fused_kernels_xla from their `lib.rs`, turns
//! every `crate::`, `super::`, `self::` and child-module path in a file into an edge to the
//! file that defines what it names (following `pub use` re-exports to their source), and fails
//! on any cycle of files, naming it. `mod` declarations are containment and `pub use`
//! re-exports are aliases: neither is an edge by itself. Also checks the house's shape: every
//! op a directory of its backends, every source file reached from its crate's root, and the
//! mirror core op ↔ NIF file ↔ Elixir module.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Colons,
    Open,
    Close,
    Comma,
    Semi,
    Hash,
    Other,
}

/// Identifiers and the punctuation a path is made of; comments, strings and chars dropped.
fn tokens(src: &str) -> Vec<Tok> {
    let b = src.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            i += 2;
            while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                i += 1;
            }
            i += 2;
        } else if c == b'r' && (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#')) {
            // Raw string: r"..." or r#"..."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&b'"') {
                out.push(Tok::Ident("r".into()));
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == b'"' && (0..hashes).all(|h| b.get(j + 1 + h) == Some(&b'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            i = j;
        } else if c == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
        } else if c == b'\'' {
            // A char literal ('x', '\n') or a lifetime ('a): skip either.
            if b.get(i + 2) == Some(&b'\'') {
                i += 3;
            } else if b.get(i + 1) == Some(&b'\\') {
                i += 2;
                while i < b.len() && b[i] != b'\'' {
                    i += 1;
                }
                i += 1;
            } else {
                i += 1;
                while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                    i += 1;
                }
            }
        } else if c.is_ascii_whitespace() {
            i += 1;
        } else if c.is_ascii_alphabetic() || c == b'_' {
            let s = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            out.push(Tok::Ident(src[s..i].to_string()));
        } else {
            out.push(match c {
                b':' if b.get(i + 1) == Some(&b':') => {
                    i += 1;
                    Tok::Colons
                }
                b'{' => Tok::Open,
                b'}' => Tok::Close,
                b',' => Tok::Comma,
                b';' => Tok::Semi,
                b'#' => Tok::Hash,
                _ => Tok::Other,
            });
            i += 1;
        }
    }
    out
}

/// A path as its segments, crate-relative once made absolute.
type ModPath = Vec<String>;

/// One file of a crate: its module path and the child modules it declares.
struct File {
    path: PathBuf,
    module: Vec<String>,
    toks: Vec<Tok>,
}

/// Reads the module tree from `root` (a crate's lib.rs).
fn crate_files(root: &Path) -> Vec<File> {
    let mut files = Vec::new();
    let mut todo = vec![(root.to_path_buf(), Vec::<String>::new())];
    while let Some((path, module)) = todo.pop() {
        let src = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
        let toks = tokens(&src);
        let stem = path.file_stem().unwrap().to_str().unwrap().to_string();
        let own_dir = if module.is_empty() || stem == "mod" {
            path.parent().unwrap().to_path_buf()
        } else {
            path.parent().unwrap().join(&stem)
        };
        // `mod name;` (an inline `mod name { .. }` stays part of this file). A `#[path]`
        // attribute would sit in a string, which the tokens drop: read it from the source.
        for (k, w) in toks.windows(3).enumerate() {
            if let [Tok::Ident(m), Tok::Ident(name), Tok::Semi] = w {
                if m == "mod" {
                    let mut child = module.clone();
                    child.push(name.clone());
                    let by_attr = path_attr(&src, name).map(|p| path.parent().unwrap().join(p));
                    let file = by_attr.unwrap_or_else(|| {
                        let flat = own_dir.join(format!("{name}.rs"));
                        if flat.exists() {
                            flat
                        } else {
                            own_dir.join(name).join("mod.rs")
                        }
                    });
                    assert!(
                        file.exists(),
                        "{path:?}: mod {name} at token {k}: no {file:?}"
                    );
                    todo.push((file, child));
                }
            }
        }
        files.push(File { path, module, toks });
    }
    files
}

/// The `#[path = "..."]` of `mod name;`, if the source gives one.
fn path_attr(src: &str, name: &str) -> Option<String> {
    let at = src.find(&format!("mod {name};"))?;
    let before = &src[..at];
    let line_start = before.trim_end().rfind('\n').map_or(0, |i| i + 1);
    let attr = before[line_start..].trim();
    let attr = attr.strip_prefix("#[path = \"")?.strip_suffix("\"]")?;
    Some(attr.to_string())
}

/// Expands the path starting at `toks[i]` (already the first segment) into full paths;
/// use-trees `a::{b, c::d}` give one path per leaf. Returns the paths and the next index.
fn read_paths(toks: &[Tok], mut i: usize, prefix: Vec<String>) -> (Vec<Vec<String>>, usize) {
    let mut path = prefix;
    loop {
        match toks.get(i) {
            Some(Tok::Ident(s)) => {
                path.push(s.clone());
                i += 1;
            }
            Some(Tok::Open) => {
                let mut all = Vec::new();
                i += 1;
                loop {
                    match toks.get(i) {
                        Some(Tok::Close) | None => return (all, i + 1),
                        Some(Tok::Comma) => i += 1,
                        _ => {
                            let (ps, j) = read_paths(toks, i, path.clone());
                            all.extend(ps);
                            i = j;
                        }
                    }
                }
            }
            _ => return (vec![path], i),
        }
        if toks.get(i) == Some(&Tok::Colons) {
            i += 1;
        } else {
            // `as` renames and everything else end the path.
            return (vec![path], i);
        }
    }
}

/// Every path a file names, made absolute (crate-relative segments); `pub use` re-exports
/// separately, by the name they export.
fn file_paths(f: &File, children: &BTreeSet<String>) -> (Vec<ModPath>, Vec<(String, ModPath)>) {
    let t = &f.toks;
    let mut paths = Vec::new();
    let mut reexports = Vec::new();
    // The module each token sits in: the file's, plus the inline `mod name { .. }` blocks
    // around it (a `super::` inside `mod avx2 { .. }` names the file's own module).
    let mut inline: Vec<Vec<String>> = Vec::with_capacity(t.len());
    let mut open: Vec<(String, usize)> = Vec::new();
    let mut depth = 0;
    for k in 0..t.len() {
        match &t[k] {
            Tok::Open => {
                depth += 1;
                if k >= 2 && t[k - 2] == Tok::Ident("mod".into()) {
                    if let Tok::Ident(name) = &t[k - 1] {
                        open.push((name.clone(), depth));
                    }
                }
            }
            Tok::Close => {
                if open.last().is_some_and(|(_, d)| *d == depth) {
                    open.pop();
                }
                depth -= 1;
            }
            _ => {}
        }
        let mut m = f.module.clone();
        m.extend(open.iter().map(|(n, _)| n.clone()));
        inline.push(m);
    }
    let mut i = 0;
    while i < t.len() {
        let after_colons = i > 0 && t[i - 1] == Tok::Colons;
        let starts = match &t[i] {
            Tok::Ident(s) if !after_colons && t.get(i + 1) == Some(&Tok::Colons) => {
                s == "crate" || s == "super" || s == "self" || children.contains(s)
            }
            _ => false,
        };
        if !starts {
            i += 1;
            continue;
        }
        let is_pub_use =
            i >= 2 && t[i - 1] == Tok::Ident("use".into()) && t[i - 2] == Tok::Ident("pub".into());
        let (ps, j) = read_paths(t, i, Vec::new());
        for p in ps {
            let abs = absolute(&inline[i], &p);
            // A re-export is an alias, not a use by this file's code: paths through it are
            // followed to the source instead.
            if is_pub_use {
                if let Some(last) = abs.last() {
                    reexports.push((last.clone(), abs.clone()));
                }
            } else {
                paths.push(abs);
            }
        }
        i = j.max(i + 1);
    }
    // A re-exported name that this file's own code also uses (outside `pub use` statements)
    // is an edge after all.
    let mut in_pub_use = vec![false; t.len()];
    let mut k = 0;
    while k + 1 < t.len() {
        if t[k] == Tok::Ident("pub".into()) && t[k + 1] == Tok::Ident("use".into()) {
            while k < t.len() && t[k] != Tok::Semi {
                in_pub_use[k] = true;
                k += 1;
            }
        }
        k += 1;
    }
    for (name, abs) in &reexports {
        let used = t.iter().enumerate().any(|(k, tok)| {
            !in_pub_use[k]
                && *tok == Tok::Ident(name.clone())
                && (k == 0 || t[k - 1] != Tok::Colons)
        });
        if used {
            paths.push(abs.clone());
        }
    }
    (paths, reexports)
}

fn absolute(module: &[String], p: &[String]) -> ModPath {
    let mut base: Vec<String> = module.to_vec();
    let mut rest = p;
    match p.first().map(String::as_str) {
        Some("crate") => {
            base.clear();
            rest = &p[1..];
        }
        Some("self") => rest = &p[1..],
        Some("super") => {
            while rest.first().map(String::as_str) == Some("super") {
                base.pop();
                rest = &rest[1..];
            }
        }
        _ => {}
    }
    base.extend(rest.iter().cloned());
    base
}

/// The file edges of one crate (`from -> to`, file paths relative to `root`'s directory).
fn crate_edges(root: &Path) -> BTreeSet<(String, String)> {
    let files = crate_files(root);
    let by_module: HashMap<Vec<String>, usize> = files
        .iter()
        .enumerate()
        .map(|(i, f)| (f.module.clone(), i))
        .collect();
    let children = |m: &[String]| -> BTreeSet<String> {
        files
            .iter()
            .filter(|f| f.module.len() == m.len() + 1 && f.module.starts_with(m))
            .map(|f| f.module.last().unwrap().clone())
            .collect()
    };
    let scanned: Vec<_> = files
        .iter()
        .map(|f| file_paths(f, &children(&f.module)))
        .collect();
    let reexports: Vec<BTreeMap<String, Vec<String>>> = scanned
        .iter()
        .map(|(_, r)| r.iter().cloned().collect())
        .collect();
    // The file defining `path`: its longest module prefix, through re-exports of that module.
    let resolve = |path: &[String]| -> Option<usize> {
        let mut p = path.to_vec();
        for _ in 0..8 {
            let k = (0..=p.len())
                .rev()
                .find(|&k| by_module.contains_key(&p[..k]))?;
            let file = by_module[&p[..k]];
            match p.get(k).and_then(|name| reexports[file].get(name)) {
                Some(src) if src.as_slice() != p.as_slice() => {
                    let mut next = src.clone();
                    next.extend(p[k + 1..].iter().cloned());
                    p = next;
                }
                _ => return Some(file),
            }
        }
        None
    };
    let dir = root.parent().unwrap();
    let name = |i: usize| {
        files[i]
            .path
            .strip_prefix(dir)
            .unwrap()
            .display()
            .to_string()
    };
    let mut edges = BTreeSet::new();
    for (from, (paths, _)) in scanned.iter().enumerate() {
        for p in paths {
            if let Some(to) = resolve(p) {
                if to != from {
                    edges.insert((name(from), name(to)));
                }
            }
        }
    }
    edges
}

/// A cycle in `edges` (its files in order, the first repeated at the end), if any.
fn find_cycle(edges: &BTreeSet<(String, String)>) -> Option<Vec<String>> {
    let mut next: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (a, b) in edges {
        next.entry(a).or_default().push(b);
        next.entry(b).or_default();
    }
    // 0 unvisited, 1 on the current path, 2 done.
    let mut state: BTreeMap<&str, u8> = next.keys().map(|k| (*k, 0)).collect();
    fn visit<'a>(
        n: &'a str,
        next: &BTreeMap<&'a str, Vec<&'a str>>,
        state: &mut BTreeMap<&'a str, u8>,
        stack: &mut Vec<&'a str>,
    ) -> Option<Vec<String>> {
        state.insert(n, 1);
        stack.push(n);
        for &m in &next[n] {
            match state[m] {
                1 => {
                    let at = stack.iter().position(|s| *s == m).unwrap();
                    let mut cycle: Vec<String> =
                        stack[at..].iter().map(|s| s.to_string()).collect();
                    cycle.push(m.to_string());
                    return Some(cycle);
                }
                0 => {
                    if let Some(c) = visit(m, next, state, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(n, 2);
        None
    }
    let keys: Vec<&str> = next.keys().copied().collect();
    for k in keys {
        if state[k] == 0 {
            if let Some(c) = visit(k, &next, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

fn edge_set(pairs: &[(&str, &str)]) -> BTreeSet<(String, String)> {
    pairs
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

#[test]
fn finds_a_circle_in_a_synthetic_edge_set() {
    // rnn/mma.rs -> rnn/mod.rs -> rnn/dispatch.rs -> rnn/mma.rs: the knot this layout removed.
    let knot = edge_set(&[
        ("rnn/mod.rs", "rnn/dispatch.rs"),
        ("rnn/dispatch.rs", "rnn/mma.rs"),
        ("rnn/dispatch.rs", "rnn/common.rs"),
        ("rnn/mma.rs", "rnn/common.rs"),
        ("rnn/mma.rs", "rnn/mod.rs"),
    ]);
    let cycle = find_cycle(&knot).expect("the circle must be found");
    assert_eq!(cycle.first(), cycle.last());
    assert_eq!(cycle.len(), 4, "{cycle:?}");
    for f in ["rnn/mod.rs", "rnn/dispatch.rs", "rnn/mma.rs"] {
        assert!(cycle.iter().any(|c| c == f), "{cycle:?}");
    }
    // The same graph with the arrow back up removed is a DAG.
    let mut dag = knot.clone();
    dag.remove(&("rnn/mma.rs".to_string(), "rnn/mod.rs".to_string()));
    assert_eq!(find_cycle(&dag), None);
    // Two files that use each other.
    let pair = edge_set(&[("a.rs", "b.rs"), ("b.rs", "a.rs")]);
    assert!(find_cycle(&pair).is_some());
}

#[test]
fn reads_edges_from_source() {
    // A re-export is followed to its source; a child module path is an edge; comments and
    // strings are not; `super::` inside an inline module names the file's own module.
    let dir = std::env::temp_dir().join(format!("fk_layout_{}", std::process::id()));
    std::fs::create_dir_all(dir.join("a")).unwrap();
    std::fs::write(
        dir.join("lib.rs"),
        "mod a;\nmod b;\npub use b::Thing;\n// crate::a::x\nconst S: &str = \"crate::a::y\";\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("a/mod.rs"),
        "mod c;\nfn f() { c::g(); }\nuse crate::Thing;\nmod inline { fn h() { super::c::g(); } }\n",
    )
    .unwrap();
    std::fs::write(dir.join("a/c.rs"), "pub fn g() {}\n").unwrap();
    std::fs::write(
        dir.join("b.rs"),
        "pub struct Thing;\nuse crate::a::{self as m};\n",
    )
    .unwrap();
    let edges = crate_edges(&dir.join("lib.rs"));
    let want = edge_set(&[
        ("a/mod.rs", "a/c.rs"),
        ("a/mod.rs", "b.rs"),
        ("b.rs", "a/mod.rs"),
    ]);
    assert_eq!(edges, want);
    // a/mod.rs uses b's Thing (through lib's re-export) while b uses a: a circle.
    assert!(find_cycle(&edges).is_some());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The workspace's library crates, each walked from its `src/lib.rs`.
const CRATES: [&str; 3] = [
    "fused_kernels_core",
    "fused_kernels_nif",
    "fused_kernels_xla",
];

#[test]
fn no_import_circle_in_any_crate() {
    let native = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    for krate in CRATES {
        let root = native.join(krate).join("src/lib.rs");
        let edges = crate_edges(&root);
        // Each crate's files use each other; a handful of edges means the walk read nothing.
        assert!(edges.len() > 5, "{krate}: only {} edges read", edges.len());
        if let Some(cycle) = find_cycle(&edges) {
            panic!("{krate}: import circle {}", cycle.join(" -> "));
        }
    }
}

/// The op names under `dir`: its `<op>.rs` files and `<op>/` folders, `mod.rs` and the names in
/// `skip` left out.
fn op_names(dir: &Path, skip: &[&str]) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.unwrap().path();
        let name = match (p.is_dir(), p.extension().and_then(|x| x.to_str())) {
            (true, _) => p.file_name(),
            (false, Some("rs")) => p.file_stem(),
            _ => None,
        };
        if let Some(n) = name.and_then(|n| n.to_str()) {
            if n != "mod" && !skip.contains(&n) {
                names.insert(n.to_string());
            }
        }
    }
    names
}

#[test]
fn every_op_has_one_nif_file_and_one_elixir_module() {
    // The mirror a reader follows: core `src/ops/<op>` ↔ NIF `src/ops/<op>.rs` ↔
    // `lib/fused_kernels/<op>.ex` ↔ `lib/fused_kernels/nx/<op>.ex`. `routes.rs` is the routing
    // table every op shares; `stream_state` (device-side helpers of the backbones' streaming)
    // has no public Elixir API.
    let core = Path::new(env!("CARGO_MANIFEST_DIR"));
    let ops = op_names(&core.join("src/ops"), &OP_HELPERS[..1]);
    let nif = op_names(&core.join("../fused_kernels_nif/src/ops"), &[]);
    assert_eq!(
        ops, nif,
        "core ops vs NIF files (native/fused_kernels_nif/src/ops)"
    );
    let lib = core.join("../../lib/fused_kernels");
    let missing: Vec<&String> = ops
        .iter()
        .filter(|op| *op != "stream_state" && !lib.join(format!("{op}.ex")).is_file())
        .collect();
    assert!(
        missing.is_empty(),
        "ops without lib/fused_kernels/<op>.ex: {missing:?}"
    );
    // And the pure-Nx implementation of each, `lib/fused_kernels/nx/<op>.ex`, nothing else there.
    let nx: BTreeSet<String> = std::fs::read_dir(lib.join("nx"))
        .unwrap()
        .filter_map(|e| {
            let p = e.unwrap().path();
            (p.extension()? == "ex").then(|| p.file_stem().unwrap().to_str().unwrap().to_string())
        })
        .collect();
    let with_nx: BTreeSet<String> = ops
        .iter()
        .filter(|o| *o != "stream_state")
        .cloned()
        .collect();
    assert_eq!(nx, with_nx, "lib/fused_kernels/nx/<op>.ex vs the core ops");
}

/// The shared helpers of `src/ops` that are files, not ops: the routing table every op shares
/// and the backbones' device-side streaming helpers.
const OP_HELPERS: [&str; 2] = ["routes", "stream_state"];

#[test]
fn every_op_is_a_directory_of_its_backends() {
    // `src/ops/<op>/`: `mod.rs` (the op's entry points and dispatch), `cpu.rs` and the CUDA
    // side, `cuda.rs` or, where several CUDA paths each win somewhere, `dispatch.rs` choosing
    // between one file per path (rnn). Parameters and geometry sit underneath both backends,
    // in `common.rs` where the op has one, so the dispatch on top never gets imported back.
    let ops_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/ops");
    let mut ops = 0;
    for e in std::fs::read_dir(&ops_dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_stem().unwrap().to_str().unwrap().to_string();
        if !p.is_dir() {
            assert!(
                name == "mod" || OP_HELPERS.contains(&name.as_str()),
                "src/ops/{name}.rs: an op is a directory src/ops/{name}/ with mod.rs, cpu.rs \
                 and cuda.rs (only the shared helpers {OP_HELPERS:?} are files)"
            );
            continue;
        }
        ops += 1;
        let has = |f: &str| p.join(f).is_file();
        for f in ["mod.rs", "cpu.rs"] {
            assert!(has(f), "src/ops/{name}/: no {f}");
        }
        assert!(
            has("cuda.rs") || has("dispatch.rs"),
            "src/ops/{name}/: no cuda.rs (nor a dispatch.rs routing between CUDA path files)"
        );
    }
    assert!(ops >= 7, "only {ops} op directories under src/ops");
}

#[test]
fn every_source_file_is_a_module_of_its_crate() {
    // A file the `mod` tree does not reach compiles nowhere and drifts: after a move, the old
    // copy or a forgotten split part would sit beside the real one.
    let native = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    for krate in CRATES {
        let src = native.join(krate).join("src");
        let reached: BTreeSet<PathBuf> = crate_files(&src.join("lib.rs"))
            .into_iter()
            .map(|f| f.path)
            .collect();
        let mut todo = vec![src.clone()];
        let mut orphans = Vec::new();
        while let Some(dir) = todo.pop() {
            for e in std::fs::read_dir(&dir).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    // src/bin holds crate roots of their own.
                    if p != src.join("bin") {
                        todo.push(p);
                    }
                } else if p.extension().and_then(|x| x.to_str()) == Some("rs")
                    && !reached.contains(&p)
                {
                    orphans.push(p.strip_prefix(native).unwrap().display().to_string());
                }
            }
        }
        assert!(
            orphans.is_empty(),
            "not reached from {krate}'s lib.rs: {orphans:?}"
        );
    }
}
