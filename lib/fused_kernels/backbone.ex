defmodule FusedKernels.Backbone do
  @moduledoc """
  ExPhil's backbones for real-time inference, from one params map (names in
  `FusedKernels.Backbone.Spec`):

    * as an Axon model: `FusedKernels.Backbone.AxonModel.build(spec)` (train it, compare);
    * `load(spec, params, opts)` → a handle. On `:cpu` and `:cuda` it holds a native engine
      built once (weights converted, packed and placed where the backend computes); on `:nx`
      Nx tensors (the pure-Nx reference);
    * `predict(handle, window)`: the whole `{batch, window, embed}` forward in one native
      call, returning the last position `{batch, hidden}`;
    * `init_state(handle, batch)` / `step(handle, state, frame)` → `{output, state}`: one
      `{batch, embed}` frame in one native call. A native state is a resource that `step`
      advances in place (the state returned is the one passed in; stepping an older copy
      continues the same stream); `reset(handle, state)` starts it over. On `:nx` states are
      values.

  Native handles need no Nx: windows and frames may be `{binary, shape, type}` triples and
  results come back as triples (Nx tensors in give Nx tensors out).
  """

  alias FusedKernels.{Backend, Buffer, Tensor}
  alias FusedKernels.Backbone.{Engine, Spec}

  @enforce_keys [:spec, :backend, :device, :weights]
  defstruct [:spec, :backend, :device, :weights, engine: nil]

  @supported [:attention, :lstm, :gru, :mamba, :jamba]
  @rnn [:lstm, :gru]

  @doc "Backbone kinds with a fused `load/3`."
  def supported, do: @supported

  @doc """
  Loads `params` (a map of the layers' parameter maps, or an `Axon.ModelState`) for `spec`.
  Options: `backend` (`:auto`, `:cuda`, `:cpu`, `:nx`), `device`. On `:cpu` and `:cuda` the
  backbone becomes a native engine (weights converted and packed once; one native call per window and
  per frame). Raises `ArgumentError` naming a missing or malformed parameter.
  """
  def load(spec, params, opts \\ [])

  def load(%Spec{kind: kind} = spec, params, opts) do
    unless kind in @supported do
      raise ArgumentError,
            "load/3 supports #{inspect(@supported)} backbones so far; build #{inspect(kind)} with " <>
              "FusedKernels.Backbone.AxonModel.build/1"
    end

    unless Keyword.keyword?(opts) do
      raise ArgumentError, "opts must be a keyword list, got: #{inspect(opts, limit: 5)}"
    end

    params = params_map(params)
    backend = select(opts)
    device = Backend.device(opts)
    weights = params |> required(spec) |> with_constants(spec)

    case backend do
      native when native in [:cpu, :cuda] ->
        engine = Engine.load(spec, weights, native, device)
        %__MODULE__{spec: spec, backend: native, device: device, weights: nil, engine: engine}

      :nx ->
        %__MODULE__{
          spec: spec,
          backend: backend,
          device: device,
          weights: to_nx_params(weights)
        }
    end
  end

  def load(spec, _params, _opts),
    do:
      raise(
        ArgumentError,
        "spec must be a FusedKernels.Backbone.Spec, got: #{inspect(spec, limit: 5)}"
      )

  defp params_map(%{__struct__: Axon.ModelState, data: data}), do: params_map(data)
  defp params_map(%{} = params) when not is_struct(params), do: params

  defp params_map(other),
    do:
      raise(
        ArgumentError,
        "params must be a map of layer name => parameter map (or an Axon.ModelState), got: " <>
          inspect(other, limit: 5)
      )

  defp select(opts) do
    case Backend.requested(opts) do
      :nx -> :nx
      _ -> Backend.select_native(opts)
    end
  end

  # The layers' parameter maps by name, checked before anything is uploaded.
  defp required(params, %Spec{} = spec) do
    Map.new(layer_names(spec), fn name ->
      case Map.fetch(params, name) do
        {:ok, %{} = p} ->
          {name, p}

        _ ->
          raise ArgumentError, "params is missing the layer \"#{name}\" (a map of its parameters)"
      end
    end)
  end

  @mamba_layers ~w(norm in_proj conv_dw_conv ssm_bc_proj ssm_dt_rank ssm_dt_proj out_proj)

  @doc "The names of the layers `spec`'s params map must hold (optional Mamba `ssm` aside)."
  def layer_names(%Spec{kind: kind, layers: layers}) when kind in @rnn,
    do: ["input_norm"] ++ Enum.flat_map(1..layers, &["rnn_#{&1}", "rnn_#{&1}_norm"])

  def layer_names(%Spec{kind: :attention, layers: layers}) do
    ["input_proj"] ++
      Enum.flat_map(1..layers, fn l ->
        ~w(q k v out norm)
        |> Enum.map(&"attn_#{l}_#{&1}")
        |> Kernel.++(Enum.map(~w(up down norm), &"ffn_#{l}_#{&1}"))
      end)
  end

  def layer_names(%Spec{kind: :mamba, layers: layers}),
    do: ["input_proj"] ++ Enum.flat_map(1..layers, &mamba_names("mamba_#{&1}"))

  def layer_names(%Spec{kind: :jamba, layers: layers} = spec) do
    ["input_proj"] ++
      Enum.flat_map(1..layers, fn l ->
        if Spec.jamba_attention?(spec, l),
          do: Enum.map(~w(attn_norm q k v out), &"jamba_#{l}_#{&1}"),
          else: mamba_names("jamba_#{l}")
      end)
  end

  defp mamba_names(prefix), do: Enum.map(@mamba_layers, &"#{prefix}_#{&1}")

  # Jamba's QK LayerNorm has no parameters: unit gain and zero shift, placed once with the rest.
  defp with_constants(w, %Spec{kind: :jamba, head_dim: d}) do
    Map.put(w, "qk_norm", %{
      "gamma" => {:binary.copy(<<1.0::float-32-native>>, d), {d}, {:f, 32}},
      "beta" => {:binary.copy(<<0.0::float-32-native>>, d), {d}, {:f, 32}}
    })
  end

  defp with_constants(w, _spec), do: w

  defp to_nx_params(params) do
    check_leaves!(params)

    unless Code.ensure_loaded?(Nx) do
      raise ArgumentError, "backend: :nx needs Nx; add {:nx, \"~> 0.7\"} or pick :cpu/:cuda"
    end

    to_nx_tree(params)
  end

  defp check_leaves!(%{} = m) when not is_struct(m),
    do: Enum.each(m, fn {_, v} -> check_leaves!(v) end)

  defp check_leaves!({bin, shape, type})
       when is_binary(bin) and is_tuple(shape) and is_tuple(type),
       do: :ok

  defp check_leaves!(%{__struct__: Nx.Tensor}), do: :ok

  defp check_leaves!(other),
    do:
      raise(
        ArgumentError,
        "params: expected tensors (Nx tensors or {binary, shape, type} triples), got: " <>
          inspect(other, limit: 5)
      )

  defp to_nx_tree(%{} = m) when not is_struct(m),
    do: Map.new(m, fn {k, v} -> {k, to_nx_tree(v)} end)

  defp to_nx_tree({_, _, _} = triple), do: apply(Tensor, :to_nx, [triple])
  defp to_nx_tree(t), do: t

  @doc """
  Random parameters for `spec` as `{binary, shape, {:f, 32}}` triples (no Nx needed), with the
  names and shapes the Axon model uses: kernels uniform in ±1/sqrt(fan_in), norm gains near 1.
  """
  def random_params(spec, seed \\ 1)

  def random_params(%Spec{kind: kind} = spec, seed) when kind in [:attention, :mamba, :jamba] do
    :rand.seed(:exsss, {seed, 7, 11})
    hid = spec.hidden
    norm = fn n -> %{"gamma" => uniform({n}, 0.1, 1.0), "beta" => uniform({n}, 0.1, 0.0)} end

    dense = fn i, o, bias_scale ->
      %{
        "kernel" => uniform({i, o}, 1 / :math.sqrt(i), 0.0),
        "bias" => uniform({o}, bias_scale, 0.0)
      }
    end

    attn = fn prefix ->
      Map.new(~w(q k v out), &{"#{prefix}_#{&1}", dense.(hid, hid, 0.1)})
    end

    mamba = fn prefix ->
      inner = spec.expand * hid

      %{
        "#{prefix}_norm" => norm.(hid),
        "#{prefix}_in_proj" => dense.(hid, 2 * inner, 0.1),
        "#{prefix}_conv_dw_conv" => %{
          "kernel" => uniform({spec.conv, 1, inner}, 0.5, 0.0),
          "bias" => uniform({inner}, 0.1, 0.0)
        },
        "#{prefix}_ssm_bc_proj" => dense.(inner, 2 * spec.state, 0.1),
        "#{prefix}_ssm_dt_rank" => dense.(inner, spec.dt_rank, 0.1),
        # dt bias around -3 puts softplus(dt) inside the clip range [0.001, 0.1] mostly.
        "#{prefix}_ssm_dt_proj" => %{
          "kernel" => uniform({spec.dt_rank, inner}, 1 / :math.sqrt(spec.dt_rank), 0.0),
          "bias" => uniform({inner}, 1.0, -3.0)
        },
        "#{prefix}_out_proj" => dense.(inner, hid, 0.1)
      }
    end

    Enum.reduce(1..spec.layers, %{"input_proj" => dense.(spec.embed, hid, 0.1)}, fn l, acc ->
      layer =
        case spec.kind do
          :attention ->
            Map.merge(attn.("attn_#{l}"), %{
              "attn_#{l}_norm" => norm.(hid),
              "ffn_#{l}_up" => dense.(hid, spec.ffn, 0.1),
              "ffn_#{l}_down" => dense.(spec.ffn, hid, 0.1),
              "ffn_#{l}_norm" => norm.(hid)
            })

          :mamba ->
            mamba.("mamba_#{l}")

          :jamba ->
            if Spec.jamba_attention?(spec, l),
              do: Map.put(attn.("jamba_#{l}"), "jamba_#{l}_attn_norm", norm.(hid)),
              else: mamba.("jamba_#{l}")
        end

      Map.merge(acc, layer)
    end)
  end

  def random_params(%Spec{kind: kind} = spec, seed) when kind in [:lstm, :gru] do
    :rand.seed(:exsss, {seed, 7, 11})
    {ins, hids, biases} = FusedKernels.Rnn.gate_names(kind)
    norm = fn n -> %{"gamma" => uniform({n}, 0.1, 1.0), "beta" => uniform({n}, 0.1, 0.0)} end

    rnn = fn input ->
      %{
        "input_kernel" =>
          Map.new(
            ins,
            &{&1, uniform({input, spec.hidden}, 1 / :math.sqrt(input), 0.0)}
          ),
        "hidden_kernel" =>
          Map.new(
            hids,
            &{&1, uniform({spec.hidden, spec.hidden}, 1 / :math.sqrt(spec.hidden), 0.0)}
          ),
        "bias" => Map.new(biases, &{&1, uniform({spec.hidden}, 0.1, 0.0)})
      }
    end

    Enum.reduce(1..spec.layers, %{"input_norm" => norm.(spec.embed)}, fn l, acc ->
      input = if l == 1, do: spec.embed, else: spec.hidden
      Map.merge(acc, %{"rnn_#{l}" => rnn.(input), "rnn_#{l}_norm" => norm.(spec.hidden)})
    end)
  end

  defp uniform(shape, scale, center) do
    bin =
      for _ <- 1..Tuple.product(shape),
          into: <<>>,
          do: <<center + scale * (2 * :rand.uniform() - 1)::float-32-native>>

    {bin, shape, {:f, 32}}
  end

  @doc "The whole window forward: `{batch, window, embed}` → `{batch, hidden}` (last position)."
  def predict(%__MODULE__{engine: ref}, window) when ref != nil, do: Engine.predict(ref, window)

  def predict(%__MODULE__{} = h, window) do
    check_input!(h, window, "window", 3)
    composed_predict(h, window)
  end

  defp composed_predict(%__MODULE__{spec: %Spec{kind: kind}, backend: :nx} = h, window)
       when kind not in @rnn,
       do: apply(FusedKernels.Backbone.NxPath, :predict, [h.spec, h.weights, window]) |> nx_last()

  defp composed_predict(%__MODULE__{spec: %Spec{kind: kind}} = h, window)
       when kind in [:lstm, :gru] do
    w = h.weights
    x = norm(h, window, w["input_norm"])

    x =
      Enum.reduce(1..h.spec.layers, x, fn l, x ->
        {seq, _} = rnn(h, x, w["rnn_#{l}"], nil)
        norm(h, seq, w["rnn_#{l}_norm"])
      end)

    last_position(x, window)
  end

  @doc """
  Zero state for `batch` rows. On `:cpu` and `:cuda` it is a `FusedKernels.Backbone.Engine.State` that
  `step/3` advances in place (the state it returns is the same one).
  """
  def init_state(%__MODULE__{} = h, batch) do
    unless is_integer(batch) and batch > 0 do
      raise ArgumentError, "batch must be a positive integer, got: #{inspect(batch)}"
    end

    composed_init_state(h, batch)
  end

  defp composed_init_state(%__MODULE__{engine: ref}, batch) when ref != nil,
    do: Engine.init_state(ref, batch)

  defp composed_init_state(%__MODULE__{spec: %Spec{kind: kind} = spec}, batch)
       when kind not in @rnn do
    apply(FusedKernels.Backbone.NxPath, :init_state, [spec, batch])
  end

  defp composed_init_state(%__MODULE__{spec: %Spec{kind: kind} = spec} = h, batch)
       when kind in [:lstm, :gru] do
    zeros = fn -> zeros({batch, spec.hidden}, h) end
    for _ <- 1..spec.layers, do: if(kind == :lstm, do: {zeros.(), zeros.()}, else: {zeros.()})
  end

  @doc "A state back at the start of a stream (an engine state is zeroed in place)."
  def reset(%__MODULE__{engine: ref}, %Engine.State{} = state) when ref != nil,
    do: Engine.reset(ref, state)

  def reset(%__MODULE__{} = h, state) do
    check_state!(h, state)
    init_state(h, state_batch(state))
  end

  @doc "One frame `{batch, embed}` in: `{output {batch, hidden}, new_state}`."
  def step(%__MODULE__{engine: ref} = h, state, frame) when ref != nil do
    check_state!(h, state)
    Engine.step(ref, state, frame)
  end

  def step(%__MODULE__{} = h, state, frame) do
    check_state!(h, state)
    check_input!(h, frame, "frame", 2)
    composed_step(h, state, frame)
  end

  # The state init_state/2 makes for this handle, checked before anything runs (a truncated
  # or foreign state would otherwise run fewer layers).
  defp check_state!(%__MODULE__{engine: ref}, state) when ref != nil do
    unless match?(%Engine.State{}, state) do
      raise ArgumentError, bad_state(state)
    end
  end

  defp check_state!(%__MODULE__{spec: %Spec{kind: kind} = spec}, state) when kind in @rnn do
    size = if kind == :lstm, do: 2, else: 1

    ok =
      is_list(state) and length(state) == spec.layers and
        Enum.all?(state, &(is_tuple(&1) and tuple_size(&1) == size))

    unless ok, do: raise(ArgumentError, bad_state(state))
  end

  defp check_state!(%__MODULE__{spec: spec}, state) do
    tags = for {kind, _} <- Spec.plan(spec), do: if(kind == :mamba, do: :mamba, else: :attn)

    ok =
      case state do
        %{count: c, layers: layers} when is_integer(c) and is_list(layers) ->
          length(layers) == length(tags) and
            Enum.all?(Enum.zip(layers, tags), fn
              {{tag, _, _}, tag} -> true
              _ -> false
            end)

        _ ->
          false
      end

    unless ok, do: raise(ArgumentError, bad_state(state))
  end

  defp bad_state(state),
    do:
      "state: expected the state init_state(handle, batch) made for this backbone, got: " <>
        inspect(state, limit: 3)

  defp state_batch(%Engine.State{batch: b}), do: b
  defp state_batch([s | _]), do: elem(shape_of(elem(s, 0)), 0)
  defp state_batch(%{layers: [{_, a, _} | _]}), do: elem(shape_of(a), 0)

  # Rank and embed of a window/frame on the composed paths (the engine checks its own).
  defp check_input!(%__MODULE__{spec: spec}, x, what, rank) do
    shape = shape_of(x)

    unless is_tuple(shape) and tuple_size(shape) == rank and elem(shape, rank - 1) == spec.embed do
      want = if rank == 3, do: "{batch, window, #{spec.embed}}", else: "{batch, #{spec.embed}}"
      raise ArgumentError, "#{what}: expected a #{want} tensor, got shape #{inspect(shape)}"
    end
  end

  defp shape_of({_, shape, _}), do: shape
  defp shape_of(%Buffer{shape: shape}), do: shape
  defp shape_of(%{__struct__: Nx.Tensor} = t), do: apply(Nx, :shape, [t])

  defp shape_of(other),
    do: raise(ArgumentError, "expected a tensor, got: #{inspect(other, limit: 3)}")

  defp composed_step(%__MODULE__{spec: %Spec{kind: kind}, backend: :nx} = h, state, frame)
       when kind not in @rnn,
       do: apply(FusedKernels.Backbone.NxPath, :step, [h.spec, h.weights, state, frame])

  defp composed_step(%__MODULE__{spec: %Spec{kind: kind}} = h, state, frame)
       when kind in [:lstm, :gru] do
    w = h.weights
    x = norm(h, as_sequence(frame), w["input_norm"])

    {x, new_state} =
      Enum.reduce(Enum.with_index(state, 1), {x, []}, fn {s, l}, {x, acc} ->
        {seq, s2} = rnn(h, x, w["rnn_#{l}"], s)
        {norm(h, seq, w["rnn_#{l}_norm"]), [s2 | acc]}
      end)

    {last_position(x, frame), Enum.reverse(new_state)}
  end

  defp norm(%__MODULE__{backend: :nx, spec: spec}, x, p),
    do:
      apply(FusedKernels, :layer_norm, [
        x,
        p["gamma"],
        p["beta"],
        [eps: spec.norm_eps, backend: :nx]
      ])

  # One recurrent layer; `state` nil means zeros. Returns `{sequence, state_tuple}`.
  defp rnn(%__MODULE__{backend: :nx, spec: spec}, x, p, state) do
    opts = if state, do: [initial_state: state, backend: :nx], else: [backend: :nx]
    apply(FusedKernels, spec.kind, [x, p, opts])
  end

  defp zeros(shape, %__MODULE__{backend: :nx}), do: apply(Nx, :broadcast, [0.0, shape])

  # A frame {batch, embed} as a one-step sequence {batch, 1, embed}.
  defp as_sequence(t) do
    {b, e} = apply(Nx, :shape, [t])
    apply(Nx, :reshape, [t, {b, 1, e}])
  end

  # The last position of a {batch, seq, hidden} result, in the caller's kind of tensor.
  defp last_position(t, _like) do
    s = elem(apply(Nx, :shape, [t]), 1)

    t
    |> then(&apply(Nx, :slice_along_axis, [&1, s - 1, 1, [axis: 1]]))
    |> then(&apply(Nx, :squeeze, [&1, [axes: [1]]]))
  end

  defp nx_last(t), do: last_position(t, nil)

  @doc """
  Writes `params` (triples) for other programs (the PyTorch side-by-side): `path.bin` holds
  the f32 data back to back, `path.json` maps "layer/group/name" to `[offset, shape]`.
  """
  def export_params(params, path) do
    {index, chunks, _} =
      params
      |> flatten_params("")
      |> Enum.reduce({[], [], 0}, fn {name, {bin, shape, {:f, 32}}}, {idx, chunks, off} ->
        entry = ~s("#{name}": [#{off}, [#{Enum.join(Tuple.to_list(shape), ", ")}]])
        {[entry | idx], [bin | chunks], off + byte_size(bin)}
      end)

    File.write!(path <> ".bin", Enum.reverse(chunks))
    File.write!(path <> ".json", "{" <> Enum.join(Enum.reverse(index), ", ") <> "}")
  end

  defp flatten_params(%{} = m, prefix) when not is_struct(m) do
    m
    |> Enum.sort()
    |> Enum.flat_map(fn {k, v} ->
      flatten_params(v, if(prefix == "", do: k, else: prefix <> "/" <> k))
    end)
  end

  defp flatten_params(triple, name), do: [{name, triple}]
end
