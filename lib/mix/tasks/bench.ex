defmodule Mix.Tasks.Bench do
  @shortdoc "Times every fused op on every available backend (the 60-FPS table)"
  @moduledoc """
  Times every case on every backend available here (CUDA, CPU-native, pure Nx when Nx is
  loaded) and prints median/p95/p99 ms, frames per second and the 60-FPS verdict.

      mix bench [--quick] [--only SUBSTRING] [--backend cuda|cuda_resident|cpu|nx ...] [--runs N] [--json PATH] [--export DIR]

  `--export DIR` writes the backbones' params and one output each for
  `bench/gpu/side_backbone.py`. The cases and the runner live in `bench/` (`bench/bench.exs`,
  `bench/cases/<op>.exs`), loaded by this task.
  """
  use Mix.Task

  @switches [
    quick: :boolean,
    only: :string,
    backend: :keep,
    json: :string,
    runs: :integer,
    export: :string
  ]

  @impl true
  @spec run([String.t()]) :: [map]
  def run(argv) do
    {opts, _rest, invalid} = OptionParser.parse(argv, strict: @switches)
    if invalid != [], do: Mix.raise("unknown options: #{inspect(invalid)}; see `mix help bench`")
    Mix.Task.run("app.start")

    backends =
      case Keyword.get_values(opts, :backend) do
        [] -> nil
        names -> Enum.map(names, &parse_backend/1)
      end

    opts =
      opts
      |> Keyword.delete(:backend)
      |> then(&if(backends, do: [{:backend, backends} | &1], else: &1))

    root = Path.expand("../../..", __DIR__)
    Code.require_file(Path.join(root, "bench/bench.exs"))
    for file <- Path.wildcard(Path.join(root, "bench/cases/*.exs")), do: Code.require_file(file)
    # Loaded just above, so not known when this task compiles.
    apply(FusedKernels.Bench, :run, [opts])
  end

  defp parse_backend(name) when name in ["cuda", "cuda_resident", "cpu", "nx"],
    do: String.to_atom(name)

  defp parse_backend(name),
    do: Mix.raise("--backend must be cuda, cuda_resident, cpu or nx, got #{name}")
end
