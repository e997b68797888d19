//! The benches' command line: flags for tuning choices and `--json FILE` for the JSON lines
//! (also printed to stdout), instead of environment variables.

use std::io::Write;
use std::str::FromStr;

pub struct Cli {
    args: Vec<String>,
}

impl Cli {
    pub fn from_env() -> Cli {
        Cli {
            args: std::env::args().skip(1).collect(),
        }
    }

    /// Whether `--name` was given.
    pub fn flag(&self, name: &str) -> bool {
        self.args.iter().any(|a| a == name)
    }

    /// The value after `--name`, parsed; exits with a message when it does not parse.
    pub fn value<T: FromStr>(&self, name: &str) -> Option<T> {
        let i = self.args.iter().position(|a| a == name)?;
        let Some(v) = self.args.get(i + 1) else {
            eprintln!("{name} needs a value");
            std::process::exit(2);
        };
        match v.parse() {
            Ok(v) => Some(v),
            Err(_) => {
                eprintln!("{name}: cannot use {v:?}");
                std::process::exit(2);
            }
        }
    }

    /// Where `--json FILE` sends the JSON lines (stdout always gets them).
    pub fn json(&self) -> JsonOut {
        JsonOut(self.value::<String>("--json").map(|p| {
            std::fs::File::create(&p).unwrap_or_else(|e| {
                eprintln!("--json {p}: {e}");
                std::process::exit(2);
            })
        }))
    }
}

/// JSON lines to stdout and, with `--json FILE`, to FILE.
pub struct JsonOut(Option<std::fs::File>);

impl JsonOut {
    pub fn line(&mut self, l: &str) {
        println!("{l}");
        if let Some(f) = &mut self.0 {
            if let Err(e) = writeln!(f, "{l}") {
                eprintln!("--json: {e}");
                std::process::exit(1);
            }
        }
    }
}
