# The Cargo compiler task is defined beside the native code; it must exist before Mix
# resolves the project's compilers.
Code.require_file("native/mix_cargo.exs", __DIR__)

defmodule FusedKernels.MixProject do
  use Mix.Project

  @version "0.1.0"

  def project do
    [
      app: :fused_kernels,
      version: @version,
      elixir: "~> 1.14",
      start_permanent: Mix.env() == :prod,
      compilers: [:fused_kernels_nif | Mix.compilers()] ++ [:fused_kernels_cache],
      elixirc_paths: ["lib"],
      deps: deps(),
      description:
        "Fused CUDA and native CPU kernels (attention, LSTM, GRU, Mamba) for Nx and Axon.",
      test_coverage: [summary: [threshold: 0]]
    ]
  end

  def application do
    [extra_applications: [:logger], mod: {FusedKernels.Application, []}]
  end

  # Users get Nx and (optionally) Axon from hex. Where Hex is not installed (CI, machines
  # without registry access) the project still builds, tests and benches its native layer:
  # the Nx-facing modules compile only when Nx is available.
  defp deps do
    if Code.ensure_loaded?(Hex) do
      [{:nx, "~> 0.7"}, {:axon, "~> 0.6", optional: true}]
    else
      []
    end
  end
end
