package main

// kubelet: the parts of a kubelet that a device plugin or a DRA driver
// meets, as upstream ships them: the device manager (registration on
// kubelet.sock, ListAndWatch, GetPreferredAllocation, Allocate, its
// checkpoint) behind the topology manager, the predicate admit handler (the
// node-total check), in the kubelet's admission order; the plugin manager
// (the watcher of <root>/plugins_registry: GetInfo on each
// <driver>-reg.sock, then NotifyRegistrationStatus) handing DRA drivers to
// the DRA manager, which prepares a pod's ResourceClaims before its
// containers start (NodePrepareResources on the endpoint the driver named),
// gives each container its CDI devices, unprepares them when the pod ends
// and keeps its checkpoint (<root>/dra_manager_state) across restarts.
// This main plays the rest: it registers the Node, watches the pods bound
// to it, admits them one at a time in creation order, records what each
// container gets under <root>/pods/, sets the pod's phase, keeps the
// Node's capacity and allocatable from the device manager, and does the
// final delete of a terminating pod.
//
// The device manager listens on the fixed /var/lib/kubelet/device-plugins;
// so that several nodes share one machine, the process re-executes itself
// in a mount namespace of its own with --device-plugins bound there. The
// plugin manager and the DRA manager take their directories as the kubelet
// hands them over (from its --root-dir), so they need no such bind.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	cadvisorapi "github.com/google/cadvisor/lib/model"
	"google.golang.org/protobuf/proto"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/record"
	"k8s.io/component-helpers/apimachinery/lease"
	"k8s.io/klog/v2"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	pluginwatcherapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	"k8s.io/kubernetes/pkg/kubelet/checkpointmanager"
	"k8s.io/kubernetes/pkg/kubelet/cm/containermap"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager/checkpoint"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	"k8s.io/kubernetes/pkg/kubelet/cm/topologymanager"
	kubeletconfig "k8s.io/kubernetes/pkg/kubelet/config"
	kubeletevents "k8s.io/kubernetes/pkg/kubelet/events"
	"k8s.io/kubernetes/pkg/kubelet/lifecycle"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
	kubetypes "k8s.io/kubernetes/pkg/kubelet/types"
	kubeletutil "k8s.io/kubernetes/pkg/kubelet/util"
	"k8s.io/utils/clock"
)

const namespacedEnv = "KUBE_PEERS_MOUNT_NS"

type kubeletFlags struct {
	kubeconfig, node, root, devicePlugins string
	nodeIP                                string
	numaNodes                             int
	cpu, memory, pods                     string
	nodeLabels                            string
	statusEvery, syncBackoff              time.Duration
}

func runKubelet(args []string) error {
	var f kubeletFlags
	fs := flag.NewFlagSet("kubelet", flag.ContinueOnError)
	fs.StringVar(&f.kubeconfig, "kubeconfig", "", "kubeconfig of the node's identity")
	fs.StringVar(&f.node, "node", "", "node name")
	fs.StringVar(&f.root, "root", "", "state directory: pods/<namespace>_<name>.json records")
	fs.StringVar(&f.devicePlugins, "device-plugins", "", "host directory served as /var/lib/kubelet/device-plugins")
	fs.StringVar(&f.nodeIP, "node-ip", "", "the node's IP: a host-network pod's IP, as the kubelet reports it")
	fs.IntVar(&f.numaNodes, "numa-nodes", 2, "NUMA nodes of the machine")
	fs.StringVar(&f.cpu, "cpu", "64", "the Node's cpu capacity")
	fs.StringVar(&f.memory, "memory", "512Gi", "the Node's memory capacity")
	fs.StringVar(&f.pods, "pods", "110", "the Node's pods capacity")
	fs.StringVar(&f.nodeLabels, "node-labels", "", "labels the Node registers with, key=value,... (the kubelet's --node-labels)")
	fs.DurationVar(&f.statusEvery, "node-status-update-frequency", time.Second, "the kubelet's nodeStatusUpdateFrequency")
	// The pod workers' backOffPeriod: a pod whose sync failed (a DRA
	// prepare error) is synced again after it, jittered by half.
	fs.DurationVar(&f.syncBackoff, "pod-sync-backoff", 10*time.Second, "the kubelet's backOffPeriod after a failed pod sync")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if f.kubeconfig == "" || f.node == "" || f.root == "" || f.devicePlugins == "" {
		return fmt.Errorf("kubelet: --kubeconfig, --node, --root and --device-plugins are required")
	}
	if os.Getenv(namespacedEnv) == "" {
		return reexecInMountNamespace()
	}
	if err := syscall.Mount(f.devicePlugins, pluginapi.DevicePluginPath, "", syscall.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind %s on %s: %w", f.devicePlugins, pluginapi.DevicePluginPath, err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	return newKubeletPeer(f).run(exitWithParent(ctx))
}

// reexecInMountNamespace runs this same command in a new mount namespace
// (Go makes its mounts private) and waits for it, passing signals on.
func reexecInMountNamespace() error {
	if err := os.MkdirAll(pluginapi.DevicePluginPath, 0o750); err != nil {
		return err
	}
	self, _ := os.Executable()
	cmd := exec.Command(self, os.Args[1:]...)
	cmd.Env = append(os.Environ(), namespacedEnv+"=1")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("mount namespace: %w", err)
	}
	signals := make(chan os.Signal, 4)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		for s := range signals {
			_ = cmd.Process.Signal(s)
		}
	}()
	err := cmd.Wait()
	if exit, ok := err.(*exec.ExitError); ok {
		os.Exit(exit.ExitCode())
	}
	return err
}

// sourcesReady reports the kubelet's pod sources ready once the pods found
// at start have been admitted again: until then the device manager treats
// containers reported running as a kubelet restart and reallocates nothing.
type sourcesReady struct{ ready atomic.Bool }

func (s *sourcesReady) AddSource(string) {}
func (s *sourcesReady) AllReady() bool   { return s.ready.Load() }

type kubeletPeer struct {
	flags   kubeletFlags
	client  kubernetes.Interface
	logger  klog.Logger
	events  record.EventRecorderLogger
	devices *devicemanager.ManagerImpl
	dra     *dra.Manager
	admit   []lifecycle.PodAdmitHandler
	sources sourcesReady
	// pods holds the pods bound to this node as the kubelet's pod config
	// last showed them: a pod missing from it is gone, which the API
	// server, through the Node authorizer, answers as Forbidden rather
	// than NotFound.
	pods cache.Store

	mu sync.Mutex
	// admitted holds the pods this node runs or is admitting (the device
	// manager's active pods); decided, every pod it admitted, rejected or
	// began stopping (none of them is admitted again).
	admitted map[types.UID]*v1.Pod
	decided  sets.Set[types.UID]
	// queue holds the pods bound here and not yet decided, in the order
	// they arrived (the kubelet's pod config hands it one update per watch
	// event, so it admits in arrival order; a relist's new pods come in one,
	// sorted by creation time).
	queue []*v1.Pod
	// resync holds admitted pods whose sync failed, due again after the
	// backoff; terminating, the pods being stopped (unprepared), so that
	// each is stopped by one goroutine however many updates come.
	resync      []types.UID
	terminating map[types.UID]chan struct{}
	// taken: pods out of the queue, not yet through admission; stopLater,
	// those of them and of the queue whose deletion came meanwhile, and
	// goneLater, those that left the API server meanwhile: as the kubelet,
	// which admits each pod it was sent before it handles the pod's later
	// updates (its config source sends the removal after the addition),
	// they are admitted first and stopped after.
	taken     sets.Set[types.UID]
	stopLater sets.Set[types.UID]
	goneLater sets.Set[types.UID]
	wake      chan struct{}
	node      *v1.Node
}

func newKubeletPeer(f kubeletFlags) *kubeletPeer {
	return &kubeletPeer{
		flags:       f,
		logger:      klog.Background().WithValues("node", f.node),
		admitted:    map[types.UID]*v1.Pod{},
		decided:     sets.New[types.UID](),
		terminating: map[types.UID]chan struct{}{},
		taken:       sets.New[types.UID](),
		stopLater:   sets.New[types.UID](),
		goneLater:   sets.New[types.UID](),
		wake:        make(chan struct{}, 1),
		pods:        cache.NewStore(cache.MetaNamespaceKeyFunc),
	}
}

func (k *kubeletPeer) run(ctx context.Context) error {
	config, err := clientcmd.BuildConfigFromFlags("", k.flags.kubeconfig)
	if err != nil {
		return err
	}
	config.QPS, config.Burst = 50, 100
	if k.client, err = kubernetes.NewForConfig(config); err != nil {
		return err
	}
	registry := filepath.Join(k.flags.root, "plugins_registry")
	for _, dir := range []string{filepath.Join(k.flags.root, "pods"), registry, filepath.Join(k.flags.root, "plugins")} {
		if err := os.MkdirAll(dir, 0o750); err != nil {
			return err
		}
	}
	ctx = klog.NewContext(ctx, k.logger)
	// The kubelet's events (a DRA prepare that failed, a plugin that could
	// not register), sent as the node.
	broadcaster := record.NewBroadcaster(record.WithContext(ctx))
	broadcaster.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: k.client.CoreV1().Events("")})
	defer broadcaster.Shutdown()
	k.events = broadcaster.NewRecorder(scheme.Scheme, v1.EventSource{Component: "kubelet", Host: k.flags.node})
	if err := k.registerNode(ctx); err != nil {
		return err
	}
	// The kubelet's heartbeat: the node lifecycle controller lifts the
	// not-ready taint only from a node whose Lease is renewed.
	leases := lease.NewController(clock.RealClock{}, k.client, k.flags.node, 40, nil, 10*time.Second,
		k.flags.node, v1.NamespaceNodeLease, kubeletutil.SetNodeOwnerFunc(ctx, k.client, k.flags.node))
	go leases.Run(ctx)
	topology := make([]cadvisorapi.Node, k.flags.numaNodes)
	for i := range topology {
		topology[i].Id = i
	}
	topologyManager, err := topologymanager.NewManager(k.logger, topology, topologymanager.PolicyNone, topologymanager.ContainerTopologyScope, nil)
	if err != nil {
		return err
	}
	if k.devices, err = devicemanager.NewManagerImpl(k.logger, topology, topologyManager); err != nil {
		return err
	}
	topologyManager.AddHintProvider(k.logger, k.devices)
	// The container manager's: its state beside the kubelet's, in the root.
	if k.dra, err = dra.NewManager(k.logger, k.client, k.flags.root); err != nil {
		return err
	}
	// The kubelet's order: the resource allocator (topology manager), then
	// the predicate handler with the device manager's node update.
	k.admit = []lifecycle.PodAdmitHandler{
		topologyManager,
		lifecycle.NewPredicateAdmitHandler(k.cachedNode, lifecycle.NewAdmissionFailureHandlerStub(), k.devices.UpdatePluginResources),
	}

	// Pods running before a restart: their containers are in the runtime.
	existing, err := k.client.CoreV1().Pods("").List(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("spec.nodeName", k.flags.node).String(),
	})
	if err != nil {
		return err
	}
	containers, running := containermap.NewContainerMap(), sets.New[string]()
	for i := range existing.Items {
		pod := &existing.Items[i]
		if pod.Status.Phase != v1.PodRunning {
			continue
		}
		for _, c := range append(append([]v1.Container{}, pod.Spec.InitContainers...), pod.Spec.Containers...) {
			id := string(pod.UID) + "/" + c.Name
			containers.Add(string(pod.UID), c.Name, id)
			running.Insert(id)
		}
	}
	// The container manager's Start: the DRA manager first (its plugin
	// handler, its reconcile loop over the active pods once sources are
	// ready; at start it deletes the node's ResourceSlices until their
	// drivers register again), then the device manager.
	if err := k.dra.Start(ctx, k.activePods, k.getNode, &k.sources); err != nil {
		return err
	}
	defer k.dra.Stop()
	if err := k.devices.Start(k.logger, k.activePods, &k.sources, containers, running); err != nil {
		return err
	}
	defer func() { _ = k.devices.Stop(k.logger) }()
	// Then, as the kubelet's initializeRuntimeDependentModules, the plugin
	// manager with the container manager's registration handlers.
	plugins := pluginmanager.NewPluginManager(registry, k.events)
	plugins.AddHandler(pluginwatcherapi.DevicePlugin, k.devices.GetWatcherHandler())
	plugins.AddHandler(pluginwatcherapi.DRAPlugin, k.dra.GetWatcherHandler())
	go plugins.Run(ctx, &k.sources, ctx.Done())

	// The kubelet's own pod source: a reflector into an undelta store,
	// merged by its pod config into ADD, UPDATE, DELETE, REMOVE and
	// RECONCILE updates in order, as its sync loop reads them.
	pods := kubeletconfig.NewPodConfig(k.events, noStartupSLI{})
	kubeletconfig.NewSourceApiserver(k.logger, k.client, types.NodeName(k.flags.node),
		func() bool { return true }, pods.Channel(ctx, kubetypes.ApiserverSource))
	first := make(chan struct{})
	go k.follow(ctx, pods.Updates(), first)
	select {
	case <-first:
	case <-ctx.Done():
		return ctx.Err()
	}
	go k.updateNodeStatus(ctx)
	go k.healthLoop(ctx)
	fmt.Println("kubelet ready:", k.flags.node)
	k.admitLoop(ctx)
	return nil
}

// follow hands the pod config's updates to admission as the kubelet's sync
// loop does: the pods of one ADD (the first list, or a relist's new pods)
// sorted by creation time, as HandlePodAdditions sorts them; a pod's
// removal after its addition. first is closed once the first update (the
// first list, maybe empty) is handed over.
func (k *kubeletPeer) follow(ctx context.Context, updates <-chan kubetypes.PodUpdate, first chan struct{}) {
	for {
		var u kubetypes.PodUpdate
		select {
		case <-ctx.Done():
			return
		case u = <-updates:
		}
		pods := slices.Clone(u.Pods)
		for _, pod := range pods {
			if u.Op == kubetypes.REMOVE {
				_ = k.pods.Delete(pod)
			} else {
				_ = k.pods.Update(pod)
			}
		}
		switch u.Op {
		case kubetypes.REMOVE:
			for _, pod := range pods {
				k.gone(ctx, pod)
			}
		case kubetypes.ADD:
			sort.SliceStable(pods, func(i, j int) bool {
				return pods[i].CreationTimestamp.Before(&pods[j].CreationTimestamp)
			})
			fallthrough
		default:
			for _, pod := range pods {
				k.observe(ctx, pod)
			}
		}
		if first != nil {
			close(first)
			first = nil
		}
	}
}

// noStartupSLI: the pod startup latency tracker the kubelet hands its pod
// config, not kept here.
type noStartupSLI struct{}

func (noStartupSLI) ObservedPodOnWatch(klog.Logger, *v1.Pod, time.Time) {}

func (k *kubeletPeer) registerNode(ctx context.Context) error {
	node := &v1.Node{
		ObjectMeta: metav1.ObjectMeta{
			Name:   k.flags.node,
			Labels: map[string]string{v1.LabelHostname: k.flags.node, v1.LabelOSStable: "linux", v1.LabelArchStable: "amd64"},
		},
	}
	// As the kubelet, a pair that is not key=value is refused, not dropped.
	for _, pair := range strings.Split(k.flags.nodeLabels, ",") {
		key, value, ok := strings.Cut(pair, "=")
		if pair != "" && !ok {
			return fmt.Errorf("--node-labels: %q is not key=value", pair)
		}
		if ok {
			node.Labels[key] = value
		}
	}
	created, err := k.client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		created, err = k.client.CoreV1().Nodes().Get(ctx, k.flags.node, metav1.GetOptions{})
	}
	if err != nil {
		return fmt.Errorf("register node: %w", err)
	}
	k.mu.Lock()
	k.node = created
	k.mu.Unlock()
	return k.syncNodeStatus(ctx)
}

func (k *kubeletPeer) cachedNode(context.Context, bool) (*v1.Node, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.node.DeepCopy(), nil
}

// getNode: the kubelet's getNodeAnyWay, for the DRA manager.
func (k *kubeletPeer) getNode(ctx context.Context) (*v1.Node, error) {
	return k.cachedNode(ctx, false)
}

// activePods: admitted and not terminal, as the kubelet's GetActivePods.
func (k *kubeletPeer) activePods() []*v1.Pod {
	k.mu.Lock()
	defer k.mu.Unlock()
	out := make([]*v1.Pod, 0, len(k.admitted))
	for _, pod := range k.admitted {
		out = append(out, pod)
	}
	return out
}

func (k *kubeletPeer) observe(ctx context.Context, pod *v1.Pod) {
	if pod.DeletionTimestamp != nil {
		if k.waiting(pod.UID, k.stopLater) || k.admitFirst(pod) {
			return
		}
		go k.finishDeletion(ctx, pod)
		return
	}
	if pod.Status.Phase == v1.PodSucceeded || pod.Status.Phase == v1.PodFailed {
		k.terminate(ctx, pod)
		return
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.decided.Has(pod.UID) {
		if _, ok := k.admitted[pod.UID]; ok {
			k.admitted[pod.UID] = pod
		}
		return
	}
	for i, queued := range k.queue {
		if queued.UID == pod.UID {
			k.queue[i] = pod
			return
		}
	}
	k.queue = append(k.queue, pod)
	k.poke()
}

// waiting: whether the pod waits for admission (queued, or taken and not
// through it yet); if so, it is marked in later, to be stopped after.
func (k *kubeletPeer) waiting(uid types.UID, later sets.Set[types.UID]) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	waiting := k.taken.Has(uid) ||
		slices.ContainsFunc(k.queue, func(p *v1.Pod) bool { return p.UID == uid })
	if waiting {
		later.Insert(uid)
	}
	return waiting
}

// admitFirst queues a pod first seen being deleted (deleted as it was
// bound) to be stopped after its admission, as the kubelet's
// HandlePodAdditions admits every pod not yet asked to terminate; false
// for a pod already decided.
func (k *kubeletPeer) admitFirst(pod *v1.Pod) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.decided.Has(pod.UID) {
		return false
	}
	k.queue = append(k.queue, pod)
	k.stopLater.Insert(pod.UID)
	k.poke()
	return true
}

func (k *kubeletPeer) poke() {
	select {
	case k.wake <- struct{}{}:
	default:
	}
}

// forget drops a pod that ended or is gone from admission and the active
// pods; the device manager frees its devices at its next allocation, as in
// the kubelet.
func (k *kubeletPeer) forget(uid types.UID) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.forgetLocked(uid)
}

func (k *kubeletPeer) forgetLocked(uid types.UID) {
	delete(k.admitted, uid)
	k.queue = slices.DeleteFunc(k.queue, func(p *v1.Pod) bool { return p.UID == uid })
}

// terminate stops a pod that ends, once, as the kubelet's
// SyncTerminatingPod: after its containers stopped (there are none here)
// and before its status changes, the DRA manager unprepares its
// ResourceClaims, again after each backoff while that fails (a driver not
// registered yet after a restart), so that no claim is deallocated while
// its driver still holds it prepared. The channel closes when that is done.
func (k *kubeletPeer) terminate(ctx context.Context, pod *v1.Pod) <-chan struct{} {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.forgetLocked(pod.UID)
	k.decided.Insert(pod.UID)
	if done, ok := k.terminating[pod.UID]; ok {
		return done
	}
	done := make(chan struct{})
	k.terminating[pod.UID] = done
	go func() {
		defer close(done)
		k.devices.UpdateAllocatedDevices(k.logger)
		for {
			err := k.dra.UnprepareResources(ctx, pod)
			if err == nil {
				return
			}
			k.logger.Error(err, "stop pod", "pod", klog.KObj(pod))
			select {
			case <-ctx.Done():
				return
			case <-time.After(wait.Jitter(k.flags.syncBackoff, 0.5)):
			}
		}
	}()
	return done
}

// gone: the pod left the API server (a final delete, or a force delete
// that did not wait for this node); it is stopped all the same, after its
// admission if it is waiting for it.
func (k *kubeletPeer) gone(ctx context.Context, pod *v1.Pod) {
	if k.waiting(pod.UID, k.goneLater) {
		return
	}
	done := k.terminate(ctx, pod)
	go func() {
		<-done
		k.mu.Lock()
		delete(k.terminating, pod.UID)
		k.mu.Unlock()
	}()
}

// finishDeletion stops the pod and deletes it for good, as the kubelet's
// status manager does once nothing of it is left on the node.
func (k *kubeletPeer) finishDeletion(ctx context.Context, pod *v1.Pod) {
	select {
	case <-k.terminate(ctx, pod):
	case <-ctx.Done():
		return
	}
	k.deleteUntilGone(ctx, pod)
}

// deleteUntilGone deletes the pod at each of the status manager's syncs
// until the pod config no longer holds it (the API server removed it),
// whatever one delete answered: the status manager tries again at its next
// sync for as long as it keeps the pod.
func (k *kubeletPeer) deleteUntilGone(ctx context.Context, pod *v1.Pod) {
	zero := int64(0)
	for !k.dropped(pod) {
		k.retry(ctx, "final delete", pod, func() (bool, error) {
			err := k.client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{
				GracePeriodSeconds: &zero,
				Preconditions:      metav1.NewUIDPreconditions(string(pod.UID)),
			})
			// A conflict: another pod of the same name (this one gone)
			// or one the pod config has yet to show; the next sync tells.
			return err == nil || apierrors.IsConflict(err), err
		})
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait.Jitter(k.flags.syncBackoff, 0.5)):
		}
	}
}

// admitLoop admits pods one at a time. The pods found at start form one
// batch, sorted by creation time as the kubelet sorts each batch (pods that
// ran before a restart go first, before sources are ready); after that the
// kubelet's batches are single watch events, so pods go in arrival order.
// Between them it syncs again the admitted pods whose backoff ran out.
func (k *kubeletPeer) admitLoop(ctx context.Context) {
	k.mu.Lock()
	batch := k.queue
	k.queue = nil
	for _, pod := range batch {
		k.taken.Insert(pod.UID)
	}
	k.mu.Unlock()
	sort.SliceStable(batch, func(i, j int) bool {
		return batch[i].CreationTimestamp.Before(&batch[j].CreationTimestamp)
	})
	for _, pod := range batch {
		k.admitTaken(ctx, pod)
	}
	k.sources.ready.Store(true)
	for {
		k.mu.Lock()
		var next, again *v1.Pod
		busy := len(k.queue) > 0 || len(k.resync) > 0
		if len(k.queue) > 0 {
			next, k.queue = k.queue[0], k.queue[1:]
			k.taken.Insert(next.UID)
		} else if len(k.resync) > 0 {
			again = k.admitted[k.resync[0]]
			k.resync = k.resync[1:]
		}
		k.mu.Unlock()
		switch {
		case next != nil:
			k.admitTaken(ctx, next)
		case again != nil:
			k.syncPod(ctx, again)
		case !busy:
			select {
			case <-ctx.Done():
				return
			case <-k.wake:
			}
		}
	}
}

// admitTaken admits a pod taken from the queue, then stops it if its
// deletion came meanwhile.
func (k *kubeletPeer) admitTaken(ctx context.Context, pod *v1.Pod) {
	k.admitOne(ctx, pod)
	k.mu.Lock()
	k.taken.Delete(pod.UID)
	later, gone := k.stopLater.Has(pod.UID), k.goneLater.Has(pod.UID)
	k.stopLater.Delete(pod.UID)
	k.goneLater.Delete(pod.UID)
	k.mu.Unlock()
	switch {
	case gone:
		k.gone(ctx, pod)
	case later:
		go k.finishDeletion(ctx, pod)
	}
}

func (k *kubeletPeer) admitOne(ctx context.Context, pod *v1.Pod) {
	attrs := &lifecycle.PodAdmitAttributes{Pod: pod, OtherPods: k.activePods(), Operation: lifecycle.AddOperation}
	// The kubelet's pod manager holds a pod before admission: the device
	// manager must see it active while its containers are allocated, or it
	// frees the pod's first containers' devices at the next allocation.
	k.mu.Lock()
	// A pod already stopped (gone from the API server before its turn) is
	// not admitted: held active, its devices would never be freed.
	if k.decided.Has(pod.UID) {
		k.mu.Unlock()
		return
	}
	k.decided.Insert(pod.UID)
	k.admitted[pod.UID] = pod
	k.mu.Unlock()
	for _, handler := range k.admit {
		if result := handler.Admit(ctx, attrs); !result.Admit {
			k.forget(pod.UID)
			k.record(pod, podRecord{Reason: result.Reason, Message: result.Message})
			k.setStatus(ctx, pod, v1.PodFailed, result.Reason, "Pod was rejected: "+result.Message)
			return
		}
	}
	k.syncPod(ctx, pod)
}

// syncPod starts an admitted pod as the kubelet's SyncPod does. Creating
// its sandbox, it prepares the pod's ResourceClaims through the DRA
// manager; a pod that ran before a restart has its sandbox, so it is not
// prepared again: its claims are in the DRA manager's checkpoint. A
// prepare that fails does not fail the pod: the kubelet emits a Warning
// FailedPrepareDynamicResources event, leaves the pod Pending and syncs it
// again after the pod workers' backoff, until it succeeds or the pod goes.
// Then each container gets its run options: the device plugins' (allocated
// at admission) and its claims' CDI devices.
func (k *kubeletPeer) syncPod(ctx context.Context, pod *v1.Pod) {
	// Stopped meanwhile (deleted while its admission ran): its claims are
	// unprepared, or about to be; preparing them now would leave them
	// prepared for a pod that is gone.
	k.mu.Lock()
	_, active := k.admitted[pod.UID]
	k.mu.Unlock()
	if !active {
		return
	}
	if pod.Status.Phase != v1.PodRunning {
		if err := k.dra.PrepareResources(ctx, pod); err != nil {
			message := fmt.Sprintf("Failed to prepare dynamic resources: %v", err)
			k.events.Event(pod, v1.EventTypeWarning, kubeletevents.FailedPrepareDynamicResources, message)
			k.record(pod, podRecord{Admitted: true, Reason: kubeletevents.FailedPrepareDynamicResources, Message: message})
			time.AfterFunc(wait.Jitter(k.flags.syncBackoff, 0.5), func() {
				k.mu.Lock()
				if _, ok := k.admitted[pod.UID]; ok {
					k.resync = append(k.resync, pod.UID)
				}
				k.mu.Unlock()
				k.poke()
			})
			return
		}
	}
	rec := podRecord{
		Admitted:   true,
		Containers: map[string]*devicemanager.DeviceRunContainerOptions{},
		CDIDevices: map[string][]string{},
	}
	for _, c := range append(append([]v1.Container{}, pod.Spec.InitContainers...), pod.Spec.Containers...) {
		opts, err := k.devices.GetDeviceRunContainerOptions(ctx, pod, &c)
		var claimed *dra.ContainerInfo
		if err == nil {
			claimed, err = k.dra.GetResources(pod, &c)
		}
		if err != nil {
			rec.Admitted, rec.Reason, rec.Message = false, "UnexpectedAdmissionError", err.Error()
			k.record(pod, rec)
			k.setStatus(ctx, pod, v1.PodFailed, rec.Reason, rec.Message)
			k.forget(pod.UID)
			return
		}
		rec.Containers[c.Name] = opts
		for _, device := range claimed.CDIDevices {
			rec.CDIDevices[c.Name] = append(rec.CDIDevices[c.Name], device.Name)
		}
	}
	k.record(pod, rec)
	if pod.Status.Phase != v1.PodRunning {
		k.setStatus(ctx, pod, v1.PodRunning, "", "")
	}
}

// podRecord is what a test reads of a pod on this node: the merged run
// options per container, each resource's own Allocate envs as the device
// manager checkpointed them (so a test sees a container whose resources
// point at different GPUs, which the merge hides), and each container's
// CDI device IDs from its ResourceClaims, as the runtime would get them.
type podRecord struct {
	Resources  map[string]map[string]map[string]string             `json:"resources,omitempty"`
	UID        types.UID                                           `json:"uid"`
	Namespace  string                                              `json:"namespace"`
	Name       string                                              `json:"name"`
	Admitted   bool                                                `json:"admitted"`
	Reason     string                                              `json:"reason,omitempty"`
	Message    string                                              `json:"message,omitempty"`
	Containers map[string]*devicemanager.DeviceRunContainerOptions `json:"containers,omitempty"`
	CDIDevices map[string][]string                                 `json:"cdiDevices,omitempty"`
}

func (k *kubeletPeer) record(pod *v1.Pod, rec podRecord) {
	rec.UID, rec.Namespace, rec.Name = pod.UID, pod.Namespace, pod.Name
	rec.Resources = k.checkpointedEnvs(pod.UID)
	data, err := json.MarshalIndent(rec, "", "  ")
	if err != nil {
		k.logger.Error(err, "record")
		return
	}
	path := filepath.Join(k.flags.root, "pods", pod.Namespace+"_"+pod.Name+".json")
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err == nil {
		_ = os.Rename(tmp, path)
	}
}

// checkpointedEnvs reads the device manager's checkpoint: container →
// resource → the envs of that resource's Allocate response.
func (k *kubeletPeer) checkpointedEnvs(uid types.UID) map[string]map[string]map[string]string {
	manager, err := checkpointmanager.NewCheckpointManager(pluginapi.DevicePluginPath)
	if err != nil {
		return nil
	}
	data := checkpoint.New(nil, nil)
	if err := manager.GetCheckpoint("kubelet_internal_checkpoint", data); err != nil {
		k.logger.Error(err, "read the device manager's checkpoint")
		return nil
	}
	entries, _ := data.GetData()
	out := map[string]map[string]map[string]string{}
	for _, e := range entries {
		if e.PodUID != string(uid) {
			continue
		}
		var resp pluginapi.ContainerAllocateResponse
		if err := proto.Unmarshal(e.AllocResp, &resp); err != nil {
			continue
		}
		if out[e.ContainerName] == nil {
			out[e.ContainerName] = map[string]map[string]string{}
		}
		out[e.ContainerName][e.ResourceName] = resp.Envs
	}
	return out
}

// setStatus writes the pod's phase, retrying until it lands or the pod is
// gone, as the kubelet's status manager keeps syncing a status that did
// not: a write lost to a busy or restarting API server would leave the pod
// Pending for good.
func (k *kubeletPeer) setStatus(ctx context.Context, pod *v1.Pod, phase v1.PodPhase, reason, message string) {
	k.retry(ctx, "status", pod, func() (bool, error) {
		current, err := k.client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil || current.UID != pod.UID {
			return err == nil, err
		}
		now := metav1.Now()
		current.Status.Phase, current.Status.Reason, current.Status.Message = phase, reason, message
		if current.Status.StartTime == nil {
			current.Status.StartTime = &now
		}
		ready := v1.ConditionFalse
		if phase == v1.PodRunning {
			ready = v1.ConditionTrue
			k.containerStatuses(current)
			// A host-network pod's IP is the node's, as the kubelet
			// reports it (the API server's pod proxy dials it).
			if current.Spec.HostNetwork && k.flags.nodeIP != "" {
				current.Status.PodIP = k.flags.nodeIP
				current.Status.PodIPs = []v1.PodIP{{IP: k.flags.nodeIP}}
			}
		}
		current.Status.Conditions = []v1.PodCondition{{Type: v1.PodReady, Status: ready, LastTransitionTime: now}}
		_, err = k.client.CoreV1().Pods(pod.Namespace).UpdateStatus(ctx, current, metav1.UpdateOptions{})
		return err == nil, err
	})
}

// containerStatuses fills in a running pod's containers as the kubelet's
// generateAPIPodStatus does: each running since its pod started, with its
// runtime ID (what a node agent maps a process's cgroup back to), and the
// health of its DRA devices as the DRA manager
// last heard it from their drivers (KEP-4680).
func (k *kubeletPeer) containerStatuses(pod *v1.Pod) {
	started := pod.Status.StartTime
	if started == nil {
		now := metav1.Now()
		started = &now
	}
	statuses := make([]v1.ContainerStatus, 0, len(pod.Spec.Containers))
	for _, c := range pod.Spec.Containers {
		yes := true
		statuses = append(statuses, v1.ContainerStatus{
			Name:        c.Name,
			Image:       c.Image,
			ImageID:     c.Image,
			ContainerID: "containerd://" + containerID(pod.UID, c.Name),
			Ready:       true,
			Started:     &yes,
			State:       v1.ContainerState{Running: &v1.ContainerStateRunning{StartedAt: *started}},
		})
	}
	pod.Status.ContainerStatuses = statuses
	k.dra.UpdateAllocatedResourcesStatus(k.logger, pod, &pod.Status)
}

// containerID is the runtime ID of container name of pod uid: 64 hex
// digits, as containerd's are, the same at every status write.
func containerID(uid types.UID, name string) string {
	sum := sha256.Sum256([]byte(string(uid) + "/" + name))
	return hex.EncodeToString(sum[:])
}

// healthLoop writes the status of each running pod whose DRA devices'
// health changed, as the kubelet's sync loop syncs the pods the container
// manager names (a pod not running yet gets it when it starts).
func (k *kubeletPeer) healthLoop(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case update := <-k.dra.Updates():
			for _, uid := range update.PodUIDs {
				k.mu.Lock()
				pod, ok := k.admitted[types.UID(uid)]
				k.mu.Unlock()
				if ok {
					k.retry(ctx, "device health", pod, func() (bool, error) {
						current, err := k.client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
						if err != nil || current.UID != pod.UID || current.Status.Phase != v1.PodRunning {
							return err == nil, err
						}
						k.containerStatuses(current)
						_, err = k.client.CoreV1().Pods(pod.Namespace).UpdateStatus(ctx, current, metav1.UpdateOptions{})
						return err == nil, err
					})
				}
			}
		}
	}
}

// forbiddenPasses is how long a Forbidden answer is taken to pass: the
// Node authorizer learns that a pod is bound to this node from its own
// informer, which may deliver the binding after this node's watch did, and
// until then refuses the node the pod ("no relationship found"); the
// kubelet's status manager retries such a write at its next sync.
const forbiddenPasses = 30 * time.Second

// retry runs write until it reports done, the pod is gone (NotFound), the
// API server refuses it for good or ctx ends. A conflict is retried at
// once; an error that may pass (no answer, a timeout, a 5xx, throttling,
// Forbidden for a while) after a backoff.
func (k *kubeletPeer) retry(ctx context.Context, what string, pod *v1.Pod, write func() (bool, error)) {
	delay := 100 * time.Millisecond
	started := time.Now()
	for {
		done, err := write()
		if done || apierrors.IsNotFound(err) {
			return
		}
		// Forbidden for a pod this node no longer has: it is gone. Waiting
		// out forbiddenPasses would hold up every pod admitted after it.
		if apierrors.IsForbidden(err) && k.dropped(pod) {
			return
		}
		if apierrors.IsConflict(err) {
			continue
		}
		k.logger.Error(err, what, "pod", klog.KObj(pod))
		var status apierrors.APIStatus
		passing := apierrors.IsServerTimeout(err) || apierrors.IsTimeout(err) ||
			apierrors.IsTooManyRequests(err) || apierrors.IsInternalError(err) ||
			apierrors.IsServiceUnavailable(err) ||
			(apierrors.IsForbidden(err) && time.Since(started) < forbiddenPasses)
		if errors.As(err, &status) && !passing {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(delay):
		}
		delay = min(2*delay, 5*time.Second)
	}
}

// dropped: the pod config no longer holds pod (by UID) bound to this node.
func (k *kubeletPeer) dropped(pod *v1.Pod) bool {
	obj, exists, err := k.pods.Get(pod)
	if err != nil || !exists {
		return err == nil
	}
	current, ok := obj.(*v1.Pod)
	return ok && current.UID != pod.UID
}

// updateNodeStatus publishes the device manager's capacity and
// allocatable whenever they change, checked every --node-status-update-frequency.
func (k *kubeletPeer) updateNodeStatus(ctx context.Context) {
	ticker := time.NewTicker(k.flags.statusEvery)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
			if err := k.syncNodeStatus(ctx); err != nil {
				k.logger.Error(err, "node status")
			}
		}
	}
}

func (k *kubeletPeer) syncNodeStatus(ctx context.Context) error {
	capacity := v1.ResourceList{
		v1.ResourceCPU:    resource.MustParse(k.flags.cpu),
		v1.ResourceMemory: resource.MustParse(k.flags.memory),
		v1.ResourcePods:   resource.MustParse(k.flags.pods),
	}
	allocatable := capacity.DeepCopy()
	if k.devices != nil {
		devCapacity, devAllocatable, _ := k.devices.GetCapacity(k.logger)
		for name, q := range devCapacity {
			capacity[name] = q
		}
		for name, q := range devAllocatable {
			allocatable[name] = q
		}
	}
	k.mu.Lock()
	node := k.node.DeepCopy()
	k.mu.Unlock()
	ready := []v1.NodeCondition{{Type: v1.NodeReady, Status: v1.ConditionTrue, Reason: "KubeletReady"}}
	if equalResources(node.Status.Capacity, capacity) && equalResources(node.Status.Allocatable, allocatable) &&
		len(node.Status.Conditions) == 1 && node.Status.Conditions[0].Status == v1.ConditionTrue {
		return nil
	}
	now := metav1.Now()
	ready[0].LastHeartbeatTime, ready[0].LastTransitionTime = now, now
	// A patch of the status alone, as the kubelet sends it: NodeRestriction
	// refuses a node's update that carries (stale) taints.
	patch, err := json.Marshal(map[string]any{"status": map[string]any{
		"capacity": capacity, "allocatable": allocatable, "conditions": ready,
	}})
	if err != nil {
		return err
	}
	updated, err := k.client.CoreV1().Nodes().PatchStatus(ctx, k.flags.node, patch)
	if err != nil {
		return err
	}
	k.mu.Lock()
	k.node = updated
	k.mu.Unlock()
	return nil
}

func equalResources(a, b v1.ResourceList) bool {
	if len(a) != len(b) {
		return false
	}
	for name, q := range a {
		other, ok := b[name]
		if !ok || q.Cmp(other) != 0 {
			return false
		}
	}
	return true
}
