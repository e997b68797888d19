if Code.ensure_loaded?(Axon) do
  defmodule FusedKernels.Axon do
    @moduledoc """
    Fused kernels inside Axon models, with the same parameters.

      * `fuse/2` walks an existing model and swaps the implementation of every node it can
        serve (`Axon.lstm` and `Axon.gru` nodes, op names `:lstm`/`:gru`) for the fused one,
        keeping names and parameters, so one params map runs either model.
      * `lstm/3,4` and `gru/3,4` build the layers as Axon does (same parameters, same return
        shapes) plus `fused: :auto | true | false`.

    Inside the graph the fused op runs through `Nx.runtime_call/4` on Nx ≥ 0.11 (gradients from
    the pure-Nx implementation, so training still works) and as the pure-Nx path on older Nx;
    see `FusedKernels.Axon.Call`. Nodes with a non-default activation or gate, or with a
    mask, keep Axon's implementation.
    """

    require Logger

    @fusable_ops [:lstm, :gru]

    defp layer_fun(:lstm), do: &FusedKernels.Axon.Layers.lstm/7
    defp layer_fun(:gru), do: &FusedKernels.Axon.Layers.gru/7

    @doc """
    Returns the model with every fusable node swapped. Options: `only:` / `except:` (lists of
    op names, e.g. `[:lstm]`, or node names). Logs what it swapped and what it left; use
    `fuse_with_report/2` to get that as data.
    """
    def fuse(%Axon{} = model, opts \\ []) do
      {model, report} = fuse_with_report(model, opts)

      Logger.info(
        "FusedKernels.Axon.fuse: swapped #{inspect(Enum.map(report.swapped, & &1.name))}, " <>
          "left #{inspect(Enum.map(report.left, &{&1.name, &1.reason}))}"
      )

      model
    end

    @doc "Like `fuse/2`, returning `{model, %{swapped: [...], left: [...]}}`."
    def fuse_with_report(%Axon{} = model, opts \\ []) do
      # `ids` (internal): restrict to these node ids, for the builders.
      opts = Keyword.validate!(opts, only: nil, except: [], ids: nil)
      {:ok, report} = Agent.start_link(fn -> %{swapped: [], left: []} end)

      fused =
        Axon.map_nodes(model, fn node ->
          case decide(node, opts) do
            {:swap, fun} ->
              Agent.update(report, &%{&1 | swapped: [entry(node) | &1.swapped]})
              %{node | op: fun}

            {:leave, reason} ->
              Agent.update(
                report,
                &%{&1 | left: [Map.put(entry(node), :reason, reason) | &1.left]}
              )

              node

            :ignore ->
              node
          end
        end)

      result = Agent.get(report, & &1)
      Agent.stop(report)
      {fused, %{swapped: Enum.reverse(result.swapped), left: Enum.reverse(result.left)}}
    end

    defp entry(node), do: %{name: node_name(node), op: node.op_name}

    defp decide(%Axon.Node{op_name: op_name} = node, opts) when op_name in @fusable_ops do
      selected? =
        (is_nil(opts[:only]) or op_name in opts[:only] or node_name(node) in opts[:only]) and
          op_name not in opts[:except] and node_name(node) not in opts[:except] and
          (is_nil(opts[:ids]) or node.id in opts[:ids])

      node_opts = node.opts

      cond do
        not selected? -> {:leave, :not_selected}
        node.op != op_name -> {:leave, :custom_op}
        Keyword.get(node_opts, :activation, :tanh) != :tanh -> {:leave, :non_default_activation}
        Keyword.get(node_opts, :gate, :sigmoid) != :sigmoid -> {:leave, :non_default_gate}
        true -> {:swap, layer_fun(op_name)}
      end
    end

    defp decide(_node, _opts), do: :ignore

    # Axon names nodes lazily (a function of the op and a counter); the given name when set.
    defp node_name(%Axon.Node{name: name}) when is_binary(name), do: name

    defp node_name(%Axon.Node{name: name, op_name: op}) when is_function(name, 2),
      do: name.(op, %{})

    defp node_name(%Axon.Node{id: id, op_name: op}), do: "#{op}_#{id}"

    @doc "`Axon.lstm/3` (random initial state) with `fused: :auto | true | false`."
    def lstm(%Axon{} = x, units, opts) when is_integer(units), do: build(:lstm, [x, units], opts)

    @doc "`Axon.lstm/4` (given initial state) with `fused:`."
    def lstm(%Axon{} = x, hidden_state, units, opts),
      do: build(:lstm, [x, hidden_state, units], opts)

    @doc "`Axon.gru/3` with `fused:`."
    def gru(%Axon{} = x, units, opts) when is_integer(units), do: build(:gru, [x, units], opts)

    @doc "`Axon.gru/4` with `fused:`."
    def gru(%Axon{} = x, hidden_state, units, opts),
      do: build(:gru, [x, hidden_state, units], opts)

    defp build(op, args, opts) do
      {fused, opts} = Keyword.pop(opts, :fused, :auto)

      unless fused in [:auto, true, false],
        do: raise(ArgumentError, "fused must be :auto, true or false, got: #{inspect(fused)}")

      {seq, state} = apply(Axon, op, args ++ [opts])

      if fused == false do
        {seq, state}
      else
        if fused == true and not fusable_opts?(opts) do
          raise ArgumentError,
                "fused: true needs the default activation (:tanh) and gate (:sigmoid), got: " <>
                  inspect(Keyword.take(opts, [:activation, :gate]))
        end

        ids = new_nodes(hd(args), seq, op)
        swap = &(&1 |> fuse_with_report(ids: ids) |> elem(0))
        {swap.(seq), map_state(state, swap)}
      end
    end

    defp fusable_opts?(opts),
      do:
        Keyword.get(opts, :activation, :tanh) == :tanh and
          Keyword.get(opts, :gate, :sigmoid) == :sigmoid

    # The nodes of `op` this builder added (not those already upstream in x).
    defp new_nodes(%Axon{nodes: before}, %Axon{nodes: after_}, op) do
      for {id, %Axon.Node{op_name: ^op} = node} <- after_,
          not Map.has_key?(before, id),
          do: node_name(node)
    end

    defp map_state(state, fun) when is_tuple(state),
      do: state |> Tuple.to_list() |> Enum.map(&map_state(&1, fun)) |> List.to_tuple()

    defp map_state(%Axon{} = a, fun), do: fun.(a)
  end
end
