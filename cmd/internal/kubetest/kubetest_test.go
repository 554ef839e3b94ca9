package kubetest_test

import (
	"context"
	"slices"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"pilab.hu/pivirt-agent/cmd/internal/kubetest"
)

func TestStart(t *testing.T) {
	const viewerToken = "viewer-token"
	s := kubetest.Start(t, kubetest.WithToken(viewerToken, "viewer", "viewers"))
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()

	// The admin, through Config and through the kubeconfig file.
	fromFile, err := clientcmd.BuildConfigFromFlags("", s.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	for name, cfg := range map[string]*rest.Config{"Config": s.Config, "Kubeconfig": fromFile} {
		list, err := kubernetes.NewForConfigOrDie(cfg).CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatalf("%s: list namespaces: %v", name, err)
		}
		var names []string
		for _, ns := range list.Items {
			names = append(names, ns.Name)
		}
		for _, want := range []string{"default", "kube-system"} {
			if !slices.Contains(names, want) {
				t.Errorf("%s: namespaces %v lack %s", name, names, want)
			}
		}
	}
	admin := kubernetes.NewForConfigOrDie(s.Config)

	// No admission plugin waits for a controller that does not run.
	labels := map[string]string{"app": "web"}
	_, err = admin.AppsV1().Deployments("default").Create(ctx, &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: "web"},
		Spec: appsv1.DeploymentSpec{
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "web", Image: "example.invalid/web"}}},
			},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create deployment: %v", err)
	}
	svc, err := admin.CoreV1().Services("default").Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "web"},
		Spec:       corev1.ServiceSpec{Selector: labels, Ports: []corev1.ServicePort{{Port: 80}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create service: %v", err)
	}
	t.Logf("service web got cluster IP %s", svc.Spec.ClusterIP)

	// A static token user has the rights RBAC gives it, no more.
	viewerCfg, err := clientcmd.BuildConfigFromFlags("", s.KubeconfigFor(viewerToken))
	if err != nil {
		t.Fatal(err)
	}
	viewer := kubernetes.NewForConfigOrDie(viewerCfg)
	if _, err := viewer.CoreV1().Namespaces().List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Fatalf("viewer listed namespaces before any RBAC grant: err %v", err)
	}
	if _, err := admin.RbacV1().ClusterRoles().Create(ctx, &rbacv1.ClusterRole{
		ObjectMeta: metav1.ObjectMeta{Name: "namespace-viewer"},
		Rules:      []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"namespaces"}, Verbs: []string{"get", "list"}}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "namespace-viewers"},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "namespace-viewer"},
		Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.GroupKind, Name: "viewers"}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// The authorizer sees the binding through its informers: eventually.
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		_, err := viewer.CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
		if err == nil {
			break
		}
		if !apierrors.IsForbidden(err) {
			t.Fatalf("viewer: list namespaces: %v", err)
		}
		select {
		case <-ctx.Done():
			t.Fatalf("viewer still forbidden after the grant: %v", err)
		case <-tick.C:
		}
	}
	if _, err := viewer.CoreV1().Secrets("default").List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Fatalf("viewer listed secrets: err %v", err)
	}
}
