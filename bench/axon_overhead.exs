# Per-call overhead of running a fused op inside a defn graph (FusedKernels.Axon.Call:
# Nx.runtime_call + custom_grad + output packing) versus calling the same op directly on
# concrete tensors, at ExPhil's shapes, on the backend the runtime_call path picks (:auto).
# Needs Nx >= 0.11 (runtime_call) and Axon; with older Nx it reports the pure-Nx path instead.
#
#   mix run bench/axon_overhead.exs [--runs N] [--json PATH]
#
# (with MIX_EXS pointing at a project that has Nx/Axon, e.g. the Nx 0.13.1 chroot.)

{opts, _, _} = OptionParser.parse(System.argv(), strict: [runs: :integer, json: :string])
runs = opts[:runs] || 30
Application.ensure_all_started(:nx)

alias FusedKernels.Axon.{Call, Layers, Ops}

rand = fn shape, scale ->
  {bin, ^shape, type} = FusedKernels.Sample.random_triple(shape, {:f, 32})
  bin |> Nx.from_binary(type) |> Nx.reshape(shape) |> Nx.multiply(scale)
end

dense_p = fn i, o -> %{"kernel" => rand.({i, o}, 0.1), "bias" => rand.({o}, 0.1)} end
gates = fn names, shape -> Map.new(names, &{&1, rand.(shape, 0.1)}) end
{b, t, i, h} = {1, 60, 288, 256}
x_rnn = rand.({b, t, i}, 1.0)
zeros = Nx.broadcast(0.0, {b, h})

mamba_params =
  FusedKernels.Sample.mamba_block_params()
  |> Map.new(fn {l, ps} ->
    {l, Map.new(ps, fn {k, tr} -> {k, FusedKernels.Tensor.to_nx(tr)} end)}
  end)

cases = [
  {"lstm B1 T60 I288 H256", Layers.LSTM,
   {x_rnn, zeros, zeros, gates.(~w(wii wif wig wio), {i, h}), gates.(~w(whi whf whg who), {h, h}),
    gates.(~w(bi bf bg bo), {h})}, []},
  {"gru B1 T60 I288 H256", Layers.GRU,
   {x_rnn, zeros, gates.(~w(wir wiz win), {i, h}), gates.(~w(whr whz whn), {h, h}),
    gates.(~w(br bz bin bhn), {h})}, []},
  {"attention B1 S60 E256 4x64 causal (+q/k/v/out dense)", Ops.Attention,
   {rand.({1, 60, 256}, 1.0),
    %{
      "q" => dense_p.(256, 256),
      "k" => dense_p.(256, 256),
      "v" => dense_p.(256, 256),
      "out" => dense_p.(256, 256)
    }}, [heads: 4, causal: true]},
  {"mamba_block B1 L60 H256 (state 16, inner 512)", Ops.MambaBlock,
   {rand.({1, 60, 256}, 1.0), mamba_params}, [name: "mamba_block"]}
]

# The same op with its kernel replaced by zeros of the output's shape: graph minus direct then
# measures only the runtime_call machinery (defn evaluation, the custom_grad wrapper, packing
# the outputs), free of the kernel's own run-to-run noise.
defmodule AxonOverheadStub do
  def fused_call(inputs, opts) do
    opts[:op].output_template(inputs, opts[:op_opts])
    |> Nx.Defn.Composite.traverse(&Nx.broadcast(Nx.tensor(0, type: Nx.type(&1)), Nx.shape(&1)))
  end

  def nx_call(inputs, opts), do: opts[:op].nx_call(inputs, opts[:op_opts])
  def output_template(inputs, opts), do: opts[:op].output_template(inputs, opts[:op_opts])
end

median = fn samples ->
  s = Enum.sort(samples)
  {Enum.at(s, div(length(s), 2)), Enum.at(s, min(length(s) - 1, round(length(s) * 0.95)))}
end

time = fn fun, n ->
  for _ <- 1..3, do: fun.()
  median.(for _ <- 1..n, do: elem(:timer.tc(fun), 0))
end

path = Call.path()

IO.puts(
  "Nx #{Application.spec(:nx, :vsn)}, Axon #{Application.spec(:axon, :vsn)}, Elixir #{System.version()}, OTP #{System.otp_release()}"
)

IO.puts(
  "path inside graphs: #{path}; backend for direct calls: #{FusedKernels.Backend.select([])}; runs #{runs}\n"
)

IO.puts(
  "| case | direct (fused_call) | in graph (compiled defn, Evaluator) | jit each call | overhead (stub kernel, median of #{runs * 10}) |"
)

IO.puts("|---|---|---|---|---|")

rows =
  for {name, op, inputs, op_opts} <- cases do
    direct = fn -> op.fused_call(inputs, op_opts) end
    graph_fun = fn ins -> Call.run(op, ins, op_opts) end
    compiled = Nx.Defn.compile(graph_fun, [inputs], compiler: Nx.Defn.Evaluator)
    jitted = Nx.Defn.jit(graph_fun, compiler: Nx.Defn.Evaluator)

    # Same numbers both ways (a wrong wiring would show here, not in the timing).
    same =
      Nx.Defn.Composite.flatten_list([direct.()])
      |> Enum.zip(Nx.Defn.Composite.flatten_list([compiled.(inputs)]))
      |> Enum.all?(fn {a, b} -> Nx.all_close(a, b, atol: 1.0e-5) |> Nx.to_number() == 1 end)

    unless same, do: raise("#{name}: graph and direct results differ")

    {d, d95} = time.(direct, runs)
    {g, g95} = time.(fn -> compiled.(inputs) end, runs)
    {j, _} = time.(fn -> jitted.(inputs) end, runs)

    stub_opts = [op: op, op_opts: op_opts]
    stub_fun = fn ins -> Call.run(AxonOverheadStub, ins, stub_opts) end
    stub_graph = Nx.Defn.compile(stub_fun, [inputs], compiler: Nx.Defn.Evaluator)
    {sd, _} = time.(fn -> AxonOverheadStub.fused_call(inputs, stub_opts) end, runs * 10)
    {sg, sg95} = time.(fn -> stub_graph.(inputs) end, runs * 10)

    IO.puts(
      "| #{name} | #{d} µs (p95 #{d95}) | #{g} µs (p95 #{g95}) | #{j} µs | #{sg - sd} µs (p95 #{sg95 - sd}; #{Float.round(100 * (sg - sd) / d, 2)}% of direct) |"
    )

    %{
      case: name,
      direct_us: d,
      direct_p95_us: d95,
      graph_us: g,
      graph_p95_us: g95,
      jit_us: j,
      overhead_us: sg - sd,
      overhead_p95_us: sg95 - sd
    }
  end

if file = opts[:json] do
  meta = %{
    nx: to_string(Application.spec(:nx, :vsn)),
    axon: to_string(Application.spec(:axon, :vsn)),
    elixir: System.version(),
    otp: System.otp_release(),
    path: path,
    runs: runs
  }

  File.write!(file, :json.encode(%{meta: meta, rows: rows}) |> IO.iodata_to_binary())
end
