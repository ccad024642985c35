package main

// dra-test-driver: a DRA driver for tests only, built on the upstream
// kubelet plugin helper (k8s.io/dynamic-resource-allocation/kubeletplugin)
// so that the kubelet peer's plugin watcher and DRA manager can be shown
// working before the product's own DRA plugin does. It publishes one
// ResourceSlice of --devices plain devices for its node, answers
// NodePrepareResources with one CDI device ID per allocated device
// (<driver>/test=<claim UID>-<device>; it writes no CDI spec: nothing here
// runs a container) and appends each registration, prepare and unprepare
// it sees to --calls as one JSON object a line, for the test to read.

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"
)

type testDriver struct {
	name string
	// failPrepares: how many NodePrepareResources calls still fail (each
	// claim in them with an error), to show the kubelet retrying.
	failPrepares int

	mu    sync.Mutex
	calls *os.File
}

// driverCall is one line of --calls.
type driverCall struct {
	Op     string    `json:"op"`
	Claim  types.UID `json:"claim,omitempty"`
	Name   string    `json:"name,omitempty"`
	Error  string    `json:"error,omitempty"`
	Device []string  `json:"devices,omitempty"`
}

func runDRATestDriver(args []string) error {
	fs := flag.NewFlagSet("dra-test-driver", flag.ContinueOnError)
	kubeconfig := fs.String("kubeconfig", "", "kubeconfig the driver publishes its ResourceSlice with")
	node := fs.String("node", "", "node name")
	driver := fs.String("driver", "", "driver name (a DNS subdomain)")
	registry := fs.String("registry", "", "the kubelet's plugins_registry directory")
	plugins := fs.String("plugins", "", "the kubelet's plugins directory: dra.sock goes in <plugins>/<driver>")
	devices := fs.Int("devices", 2, "devices in the published pool")
	calls := fs.String("calls", "", "file each call is appended to, as JSON lines")
	failPrepares := fs.Int("fail-prepares", 0, "NodePrepareResources calls that fail first")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *kubeconfig == "" || *node == "" || *driver == "" || *registry == "" || *plugins == "" || *calls == "" {
		return fmt.Errorf("dra-test-driver: --kubeconfig, --node, --driver, --registry, --plugins and --calls are required")
	}
	_, client, err := clientFor(*kubeconfig)
	if err != nil {
		return err
	}
	dataDir := *plugins + "/" + *driver
	if err := os.MkdirAll(dataDir, 0o750); err != nil {
		return err
	}
	log, err := os.OpenFile(*calls, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer log.Close()
	d := &testDriver{name: *driver, failPrepares: *failPrepares, calls: log}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	ctx = klog.NewContext(exitWithParent(ctx), klog.Background().WithValues("driver", *driver))
	helper, err := kubeletplugin.Start(ctx, d,
		kubeletplugin.DriverName(*driver),
		kubeletplugin.NodeName(*node),
		kubeletplugin.KubeClient(client),
		kubeletplugin.RegistrarDirectoryPath(*registry),
		kubeletplugin.PluginDataDirectoryPath(dataDir),
		kubeletplugin.HealthService(false),
	)
	if err != nil {
		return fmt.Errorf("start the kubelet plugin: %w", err)
	}
	defer helper.Stop()
	slice := resourceslice.Slice{}
	for i := range *devices {
		slice.Devices = append(slice.Devices, resourceapi.Device{Name: fmt.Sprintf("dev-%d", i)})
	}
	if err := helper.PublishResources(ctx, resourceslice.DriverResources{
		Pools: map[string]resourceslice.Pool{*node: {Slices: []resourceslice.Slice{slice}}},
	}); err != nil {
		return err
	}
	fmt.Println("dra-test-driver started:", *driver)
	// The kubelet's NotifyRegistrationStatus, once it came.
	for ctx.Err() == nil {
		if status := helper.RegistrationStatus(); status != nil {
			d.log(driverCall{Op: "registered", Error: status.Error})
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	<-ctx.Done()
	return nil
}

func (d *testDriver) log(call driverCall) {
	line, _ := json.Marshal(call)
	d.mu.Lock()
	defer d.mu.Unlock()
	_, _ = d.calls.Write(append(line, '\n'))
}

func (d *testDriver) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	d.mu.Lock()
	fail := d.failPrepares > 0
	if fail {
		d.failPrepares--
	}
	d.mu.Unlock()
	out := map[types.UID]kubeletplugin.PrepareResult{}
	for _, claim := range claims {
		call := driverCall{Op: "prepare", Claim: claim.UID, Name: claim.Name}
		var result kubeletplugin.PrepareResult
		if fail {
			result.Err = errors.New("dra-test-driver: injected prepare failure")
			call.Error = result.Err.Error()
		} else if claim.Status.Allocation != nil {
			for _, r := range claim.Status.Allocation.Devices.Results {
				if r.Driver != d.name {
					continue
				}
				id := fmt.Sprintf("%s/test=%s-%s", d.name, claim.UID, r.Device)
				result.Devices = append(result.Devices, kubeletplugin.Device{
					Requests: []string{r.Request}, PoolName: r.Pool, DeviceName: r.Device, CDIDeviceIDs: []string{id},
				})
				call.Device = append(call.Device, id)
			}
		}
		d.log(call)
		out[claim.UID] = result
	}
	return out, nil
}

func (d *testDriver) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	out := map[types.UID]error{}
	for _, claim := range claims {
		d.log(driverCall{Op: "unprepare", Claim: claim.UID, Name: claim.Name})
		out[claim.UID] = nil
	}
	return out, nil
}

func (d *testDriver) HandleError(ctx context.Context, err error, msg string) {
	klog.FromContext(ctx).Error(err, msg)
}

func (d *testDriver) WatchHealthStatus(context.Context, chan<- kubeletplugin.DeviceHealthReport) error {
	return kubeletplugin.ErrHealthNotSupported
}
