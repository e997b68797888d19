defmodule Mix.Tasks.Compile.FusedKernelsNif do
  @moduledoc """
  Builds the Rust NIF with `cargo build --release` and installs it as
  `priv/native/libfused_kernels_nif.so`.

  Incremental: cargo runs only when a file under `native/` or `Cargo.toml`/`Cargo.lock`
  is newer than the installed library. Cargo's own output is shown as it runs.

  Environment:
    * `FUSED_KERNELS_SKIP_NIF=1` - do not build (the library is prebuilt, e.g. on a GPU
      machine without Rust, or the pure-Nx backend is all you need).
    * `CARGO` - the cargo executable (default: `cargo` on the PATH).
  """
  use Mix.Task.Compiler

  @lib "libfused_kernels_nif"

  @impl true
  def run(_args) do
    root = Path.expand("..", __DIR__)
    installed = Path.join([root, "priv", "native", @lib <> ".so"])

    cond do
      System.get_env("FUSED_KERNELS_SKIP_NIF") in ["1", "true"] ->
        {:noop, []}

      up_to_date?(root, installed) ->
        {:noop, []}

      true ->
        build(root, installed)
    end
  end

  defp build(root, installed) do
    cargo = System.get_env("CARGO") || System.find_executable("cargo")

    if is_nil(cargo) do
      message =
        "cargo was not found on the PATH. fused_kernels builds its native library with Rust: " <>
          "install a Rust toolchain (https://rustup.rs), or set FUSED_KERNELS_SKIP_NIF=1 to " <>
          "build without it (only the pure-Nx backend will be available)."

      Mix.shell().error(message)
      {:error, [diagnostic(message)]}
    else
      Mix.shell().info("Compiling the fused_kernels NIF (cargo build --release)")

      {_, status} =
        System.cmd(cargo, ["build", "--release", "-p", "fused_kernels_nif"],
          cd: root,
          into: IO.stream(:stdio, :line),
          stderr_to_stdout: true
        )

      built = Path.join([target_dir(root), "release", @lib <> ext()])

      cond do
        status != 0 ->
          message = "cargo build --release failed with status #{status} (output above)"
          Mix.shell().error(message)
          {:error, [diagnostic(message)]}

        not File.exists?(built) ->
          message = "cargo succeeded but #{built} is missing"
          Mix.shell().error(message)
          {:error, [diagnostic(message)]}

        true ->
          File.mkdir_p!(Path.dirname(installed))
          # Copy to a new file and rename: a loaded NIF must not be overwritten in place.
          tmp = installed <> ".tmp"
          File.cp!(built, tmp)
          File.rename!(tmp, installed)
          # Links priv/ into _build when it did not exist before this compiler ran.
          Mix.Project.build_structure()
          {:ok, []}
      end
    end
  end

  defp up_to_date?(root, installed) do
    case File.stat(installed, time: :posix) do
      {:ok, %{mtime: built_at}} ->
        sources =
          Path.wildcard(Path.join(root, "native/**/*.{rs,cu,cuh,toml}")) ++
            Enum.map(["Cargo.toml", "Cargo.lock"], &Path.join(root, &1))

        Enum.all?(sources, fn src ->
          case File.stat(src, time: :posix) do
            {:ok, %{mtime: m}} -> m <= built_at
            _ -> true
          end
        end)

      _ ->
        false
    end
  end

  defp target_dir(root), do: System.get_env("CARGO_TARGET_DIR") || Path.join(root, "target")

  defp ext do
    case :os.type() do
      {:unix, :darwin} -> ".dylib"
      _ -> ".so"
    end
  end

  defp diagnostic(message) do
    %Mix.Task.Compiler.Diagnostic{
      compiler_name: "fused_kernels_nif",
      file: "Cargo.toml",
      message: message,
      position: nil,
      severity: :error
    }
  end
end
