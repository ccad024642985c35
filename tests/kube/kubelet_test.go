package main

import (
	"context"
	"slices"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"
	kubetypes "k8s.io/kubernetes/pkg/kubelet/types"
)

// A status write for a pod this node no longer has is answered Forbidden
// by the Node authorizer, not NotFound. The chaos run (tests/kube_chaos.rs)
// found the peer retrying it for forbiddenPasses, its admission of every
// later pod held up meanwhile: it must give up at once. A pod it still has
// (the authorizer has not learnt the binding yet) is retried.
func TestStatusOfAPodGoneIsNotRetried(t *testing.T) {
	k := newKubeletPeer(kubeletFlags{node: "node-0"})
	k.pods = cache.NewStore(cache.MetaNamespaceKeyFunc)
	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p", UID: "a"}}
	forbidden := apierrors.NewForbidden(schema.GroupResource{Resource: "pods"}, "p",
		errFor("no relationship found between node 'node-0' and this object"))

	writes := 0
	started := time.Now()
	k.retry(context.Background(), "status", pod, func() (bool, error) {
		writes++
		return false, forbidden
	})
	if writes != 1 || time.Since(started) > time.Second {
		t.Fatalf("a gone pod's write was tried %d times over %v", writes, time.Since(started))
	}

	// Held by this node (the same UID): retried until it lands.
	if err := k.pods.Add(pod); err != nil {
		t.Fatal(err)
	}
	writes = 0
	k.retry(context.Background(), "status", pod, func() (bool, error) {
		writes++
		return writes == 3, forbidden
	})
	if writes != 3 {
		t.Fatalf("a held pod's write was tried %d times, want 3", writes)
	}

	// Another pod of the same name (another UID): the one written for is gone.
	other := pod.DeepCopy()
	other.UID = "b"
	if err := k.pods.Update(other); err != nil {
		t.Fatal(err)
	}
	writes = 0
	k.retry(context.Background(), "status", pod, func() (bool, error) {
		writes++
		return false, forbidden
	})
	if writes != 1 {
		t.Fatalf("a replaced pod's write was tried %d times", writes)
	}
}

// The kubelet admits every pod its config source sent it before it handles
// the pod's removal, sent after: a pod deleted from the API server at once
// (deleted as it was bound) is admitted, its devices allocated, then
// stopped. The peer dropped it from its queue instead, so the device
// plugin's Allocates for it never came (found by the chaos run, after the
// daemon learnt to wait for them).
func TestAPodGoneBeforeItsTurnIsAdmittedThenStopped(t *testing.T) {
	k := newKubeletPeer(kubeletFlags{node: "node-0"})
	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p", UID: "a"}}
	k.observe(context.Background(), pod)
	k.gone(context.Background(), pod)
	if len(k.queue) != 1 || k.decided.Has(pod.UID) || !k.goneLater.Has(pod.UID) {
		t.Fatalf("queue %v, decided %v, goneLater %v", k.queue, k.decided, k.goneLater)
	}
}

// A pod the kubelet first sees already being deleted (deleted as it was
// bound: a bound pod's deletion is graceful) is admitted all the same, its
// devices allocated, then stopped: HandlePodAdditions admits every pod not
// yet asked to terminate. The peer stopped it unadmitted, and the daemon,
// which rightly waited for its Allocates, gave them to the next pod of the
// same ask (found by the 10,000-pod chaos run).
func TestAPodFirstSeenBeingDeletedIsAdmittedThenStopped(t *testing.T) {
	k := newKubeletPeer(kubeletFlags{node: "node-0"})
	now := metav1.Now()
	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p", UID: "a", DeletionTimestamp: &now}}
	k.observe(context.Background(), pod)
	if len(k.queue) != 1 || !k.stopLater.Has(pod.UID) {
		t.Fatalf("queue %v, stopLater %v", k.queue, k.stopLater)
	}
}

// A relist hands the kubelet the pods it missed in one ADD, which it
// admits sorted by creation time, not in the order the list (by name)
// returned them: the peer's informer queued them in list order, so after an
// API server restart it admitted p100 before p99, unlike the kubelet, and
// the daemon, matching in the kubelet's order, seemed to hand pods each
// other's grants (found by the chaos run). A removal comes after.
func TestARelistsPodsAreAdmittedInCreationOrder(t *testing.T) {
	k := newKubeletPeer(kubeletFlags{node: "node-0"})
	at := func(name string, second int) *v1.Pod {
		created := metav1.NewTime(time.Unix(int64(second), 0))
		return &v1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name,
			UID: types.UID(name), CreationTimestamp: created}}
	}
	updates := make(chan kubetypes.PodUpdate, 2)
	updates <- kubetypes.PodUpdate{Op: kubetypes.ADD, Pods: []*v1.Pod{at("p100", 2), at("p99", 1)}}
	updates <- kubetypes.PodUpdate{Op: kubetypes.ADD, Pods: []*v1.Pod{at("p101", 0)}}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	first := make(chan struct{})
	go k.follow(ctx, updates, first)
	<-first
	deadline := time.Now().Add(10 * time.Second)
	for {
		k.mu.Lock()
		var names []string
		for _, p := range k.queue {
			names = append(names, p.Name)
		}
		k.mu.Unlock()
		if slices.Equal(names, []string{"p99", "p100", "p101"}) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("queue %v", names)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if _, held, _ := k.pods.GetByKey("ns/p100"); !held {
		t.Fatal("the pod config's pods are not held")
	}
}

// The status manager deletes a finished pod again at each sync for as long
// as it has the pod; the peer took a delete answered 409 Conflict for done,
// so a pod whose delete was so answered as the API server restarted stayed
// Terminating for good (found by the chaos run: seed 4, p774). It deletes
// again until the pod config no longer holds the pod.
func TestAFinalDeleteIsTriedAgainUntilThePodIsGone(t *testing.T) {
	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p", UID: "a"}}
	k := newKubeletPeer(kubeletFlags{node: "node-0", syncBackoff: time.Millisecond})
	client := fake.NewClientset(pod)
	deletes := 0
	client.PrependReactor("delete", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
		deletes++
		if deletes == 1 {
			return true, nil, apierrors.NewConflict(schema.GroupResource{Resource: "pods"}, "p",
				errFor("the object has been modified"))
		}
		// Removed: the pod config drops it.
		_ = k.pods.Delete(pod)
		return false, nil, nil
	})
	k.client = client
	if err := k.pods.Add(pod); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	k.deleteUntilGone(ctx, pod)
	_, err := client.CoreV1().Pods("ns").Get(context.Background(), "p", metav1.GetOptions{})
	if !apierrors.IsNotFound(err) || deletes != 2 {
		t.Fatalf("after %d deletes the pod is still there (get: %v)", deletes, err)
	}
}

type errFor string

func (e errFor) Error() string { return string(e) }
