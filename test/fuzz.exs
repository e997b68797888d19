# The NIF fuzz (test/support/nif_fuzz.exs) from the command line: long runs, replay, and
# crash bisection down to a one-line reproduction.
#
#   mix run test/fuzz.exs --seed 7 --calls 100000          run calls 0..99999 of seed 7 (:cpu)
#   mix run test/fuzz.exs --seed 7 --from 500 --to 600     run a range only
#   mix run test/fuzz.exs --seed 7 --only 523              replay one call, print it
#   mix run test/fuzz.exs --seed 7 --calls 100000 --backend cuda   the same on the GPU
#   mix run test/fuzz.exs --seed 7 --calls 100000 --bisect
#       run the range in child VMs; when one dies (or a call breaks the contract), halve the
#       range until one call is left, drop the junk arguments that are not needed to break it,
#       and print that call as one line of Elixir
#
# Without --seed a random seed is used and printed. Exit status 0 when every call kept the
# contract, 1 otherwise. Progress goes to stderr every 10,000 calls. On --backend cuda, valid
# calls the GPU refuses are listed apart (see FusedKernels.NifFuzz).
Code.require_file("support/nif_fuzz.exs", __DIR__)

alias FusedKernels.NifFuzz

{opts, _, _} =
  OptionParser.parse(System.argv(),
    strict: [
      seed: :integer,
      calls: :integer,
      from: :integer,
      to: :integer,
      only: :integer,
      drop: :string,
      concurrency: :integer,
      backend: :string,
      bisect: :boolean
    ]
  )

seed = opts[:seed] || :rand.uniform(1_000_000_000)
from = opts[:from] || 0
to = opts[:to] || from + (opts[:calls] || 10_000)
concurrency = opts[:concurrency] || 4

backend =
  case opts[:backend] || "cpu" do
    "cpu" -> :cpu
    "cuda" -> :cuda
    other -> raise ArgumentError, "--backend must be cpu or cuda, got: #{other}"
  end

drop =
  case opts[:drop] do
    nil -> []
    "" -> []
    s -> s |> String.split(",") |> Enum.map(&String.to_integer/1)
  end

defmodule FuzzCli do
  # Runs a range (or one call with drops) in a fresh VM; true when it kept the contract.
  def child_ok?(seed, backend, args) do
    argv = ["run", __ENV__.file, "--seed", to_string(seed), "--backend", "#{backend}" | args]
    {out, status} = System.cmd("mix", argv, stderr_to_stdout: true, env: [{"MIX_ENV", "test"}])
    if status != 0, do: IO.write(:stderr, String.slice(out, -2000, 2000))
    status == 0
  end

  def bisect(_seed, _backend, from, to) when to - from <= 1, do: from

  def bisect(seed, backend, from, to) do
    mid = div(from + to, 2)
    IO.puts(:stderr, "bisect: #{from}..#{to - 1}")

    if child_ok?(seed, backend, ["--from", "#{from}", "--to", "#{mid}", "--concurrency", "1"]),
      do: bisect(seed, backend, mid, to),
      else: bisect(seed, backend, from, mid)
  end

  # Drops each junk argument in turn while the call still breaks the contract.
  def shrink(seed, backend, i) do
    {_, _, mutations} = NifFuzz.generate(seed, i, [], backend)

    Enum.reduce(0..(length(mutations) - 1)//1, [], fn k, dropped ->
      try = Enum.join([k | dropped], ",")

      if child_ok?(seed, backend, ["--only", "#{i}", "--drop", try]),
        do: dropped,
        else: [k | dropped]
    end)
  end
end

IO.puts("fuzz seed #{seed}, backend #{backend}")

cond do
  opts[:only] ->
    i = opts[:only]
    IO.puts(NifFuzz.one_line(seed, i, drop, backend))

    case NifFuzz.check(NifFuzz.generate(seed, i, drop, backend), backend) do
      {:bad, why} ->
        IO.puts("contract broken: #{why}")
        System.halt(1)

      outcome ->
        IO.puts("kept the contract: #{inspect(outcome)}")
    end

  opts[:bisect] ->
    if FuzzCli.child_ok?(seed, backend, ["--from", "#{from}", "--to", "#{to}"]) do
      IO.puts("calls #{from}..#{to - 1} of seed #{seed}: no failure")
    else
      i = FuzzCli.bisect(seed, backend, from, to)
      drop = FuzzCli.shrink(seed, backend, i)
      IO.puts("first failing call: #{i} (seed #{seed})")

      IO.puts(
        "reproduce: mix run test/fuzz.exs --seed #{seed} --backend #{backend} --only #{i} " <>
          "--drop '#{Enum.join(drop, ",")}'"
      )

      IO.puts(NifFuzz.one_line(seed, i, drop, backend))
      System.halt(1)
    end

  true ->
    started = System.monotonic_time(:millisecond)

    progress = fn i ->
      if rem(i, 10_000) == 0, do: IO.puts(:stderr, "call #{i}")
    end

    r = NifFuzz.run(seed, from, to, concurrency, progress, backend)
    ms = System.monotonic_time(:millisecond) - started

    IO.puts(
      "#{r.calls} calls (#{from}..#{to - 1}) in #{ms} ms: #{r.ok} ok, #{r.errors} error replies, " <>
        "#{length(r.failures)} contract failures, #{length(r.refused)} valid calls refused; " <>
        "ok per NIF #{inspect(r.ok_by_nif)}"
    )

    r.refused
    |> Enum.group_by(fn {_, nif, why} -> {nif, why} end)
    |> Enum.sort_by(fn {_, calls} -> -length(calls) end)
    |> Enum.take(20)
    |> Enum.each(fn {{nif, why}, [{i, _, _} | _] = calls} ->
      IO.puts("refused #{length(calls)}x #{nif}: #{why} (e.g. call #{i})")
    end)

    for {i, why} <- Enum.take(Enum.sort(r.failures), 20) do
      IO.puts("call #{i}: #{why}\n  #{NifFuzz.one_line(seed, i, [], backend)}")
    end

    if r.failures != [], do: System.halt(1)
end
