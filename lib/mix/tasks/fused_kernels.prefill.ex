defmodule Mix.Tasks.FusedKernels.Prefill do
  @shortdoc "Compiles the kernel cache for given GPU architectures ahead of time"
  @moduledoc """
  Fills a kernel cache directory with every program the runtime may load on the given GPU
  architectures, without a GPU (NVRTC only), so that first calls there compile nothing
  (see `FusedKernels.prefill/1`).

      mix fused_kernels.prefill [--arch sm_90[,sm_120]] [--cache DIR] [--as sm_86] [--jobs N]

  `--arch` defaults to the local GPU's; `--cache` to the runtime's cache directory (the
  application's `:cache_dir`, `FUSED_KERNELS_CACHE_DIR`, or the user cache dir). Ship the
  directory with a release and point `config :fused_kernels, cache_dir:` (or
  `FUSED_KERNELS_CACHE_DIR`) at it; the entries are used where NVRTC's major.minor is the one
  that built them.
  """
  use Mix.Task

  @switches [arch: :keep, cache: :string, as: :string, jobs: :integer]

  @impl true
  @spec run([String.t()]) :: :ok
  def run(argv) do
    {opts, rest, invalid} = OptionParser.parse(argv, strict: @switches)

    if invalid != [] or rest != [] do
      Mix.raise(
        "unknown arguments #{inspect(invalid ++ rest)}; see `mix help fused_kernels.prefill`"
      )
    end

    Mix.Task.run("compile")
    Mix.Task.run("loadpaths")

    archs =
      opts
      |> Keyword.get_values(:arch)
      |> Enum.flat_map(&String.split(&1, ",", trim: true))

    if not FusedKernels.Native.loaded?() do
      Mix.raise("the fused_kernels NIF did not load: #{inspect(FusedKernels.Native.status())}")
    end

    if archs == [] and FusedKernels.local_arch() == nil do
      Mix.raise(
        "no GPU here (#{FusedKernels.info()[:reason]}): name the architectures, e.g. --arch sm_90"
      )
    end

    dir =
      opts[:cache] || Application.get_env(:fused_kernels, :cache_dir) ||
        FusedKernels.info()[:cache_dir]

    prefill_opts =
      [cache_dir: Path.expand(dir), route_as: opts[:as]]
      |> then(&if archs == [], do: &1, else: Keyword.put(&1, :archs, archs))
      |> then(&if opts[:jobs], do: Keyword.put(&1, :jobs, opts[:jobs]), else: &1)

    started = System.monotonic_time(:millisecond)
    report = FusedKernels.prefill(prefill_opts)
    seconds = (System.monotonic_time(:millisecond) - started) / 1000

    Mix.shell().info(
      "fused_kernels: #{report.compiled} programs compiled, #{report.present} already cached, " <>
        "#{length(report.failed)} failed, #{Float.round(report.bytes / 1_048_576, 1)} MiB " <>
        "in #{Path.expand(dir)} (#{Float.round(seconds, 1)} s)"
    )

    if report.failed != [] do
      Mix.raise("kernels that did not compile:\n" <> Enum.join(report.failed, "\n"))
    end

    :ok
  end
end
