defmodule Mix.Tasks.Compile.FusedKernelsCache do
  @moduledoc """
  After the project compiles, pre-fills the kernel cache (`FusedKernels.prefill/1`) so that
  first calls compile nothing: for the local GPU's architecture when NVRTC and a GPU are
  found, or for the architectures configured for a release:

      config :fused_kernels, prefill: :local              # default
      config :fused_kernels, prefill: ["sm_86", "sm_120"] # a release for those GPUs
      config :fused_kernels, prefill: false               # never

  into the configured `:cache_dir` (else the runtime's default). It runs again only when the
  NIF, the architectures or the directory change; NVRTC missing, or no GPU with `:local`,
  skips it quietly. A failure is reported and does not fail the build.
  """
  use Mix.Task.Compiler

  @impl true
  def run(_args) do
    with setting when setting != false <- Application.get_env(:fused_kernels, :prefill, :local),
         {:module, _} <- Code.ensure_loaded(FusedKernels.Native),
         true <- FusedKernels.Native.loaded?(),
         archs when archs != [] <- archs(setting) do
      dir =
        Path.expand(
          Application.get_env(:fused_kernels, :cache_dir) || FusedKernels.info()[:cache_dir]
        )

      stamp = {nif_stamp(), archs, dir}

      if read_manifest() == stamp do
        {:noop, []}
      else
        prefill(archs, dir, stamp)
      end
    else
      _ -> {:noop, []}
    end
  end

  @impl true
  def manifests, do: [manifest()]

  @impl true
  def clean, do: File.rm(manifest())

  defp archs(:local), do: List.wrap(FusedKernels.local_arch())
  defp archs(list) when is_list(list), do: list

  defp archs(other) do
    Mix.shell().error(
      "config :fused_kernels, prefill: must be :local, false or a list like [\"sm_90\"], " <>
        "got #{inspect(other)}; not pre-filling the kernel cache"
    )

    []
  end

  defp prefill(archs, dir, stamp) do
    Mix.shell().info(
      "Pre-filling the fused_kernels kernel cache for #{Enum.join(archs, ", ")} in #{dir}"
    )

    try do
      report = FusedKernels.prefill(archs: archs, cache_dir: dir)

      Mix.shell().info(
        "fused_kernels: #{report.compiled} programs compiled, #{report.present} already cached"
      )

      if report.failed == [] do
        write_manifest(stamp)
      else
        Mix.shell().error("fused_kernels: did not compile: #{Enum.join(report.failed, "; ")}")
      end

      {:ok, []}
    rescue
      e ->
        Mix.shell().error("fused_kernels: kernel cache not pre-filled: #{Exception.message(e)}")
        {:ok, []}
    end
  end

  defp nif_stamp do
    path =
      case :code.priv_dir(:fused_kernels) do
        {:error, _} -> nil
        priv -> Path.join([to_string(priv), "native", "libfused_kernels_nif.so"])
      end

    case path && File.stat(path) do
      {:ok, %File.Stat{mtime: mtime, size: size}} -> {mtime, size}
      _ -> nil
    end
  end

  defp manifest, do: Path.join(Mix.Project.manifest_path(), "compile.fused_kernels_cache")

  defp read_manifest do
    case File.read(manifest()) do
      {:ok, bin} -> :erlang.binary_to_term(bin, [:safe])
      _ -> nil
    end
  rescue
    ArgumentError -> nil
  end

  defp write_manifest(stamp) do
    File.mkdir_p!(Path.dirname(manifest()))
    File.write!(manifest(), :erlang.term_to_binary(stamp))
  end
end
