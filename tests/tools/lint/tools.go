//go:build tools

// The chart linters the chart tests run (tests/tools/build.sh builds them into target/tools/bin/):
// chart-testing's `ct lint`, kube-score and kubeconform, pinned by this module's go.mod.
package tools

import (
	_ "github.com/helm/chart-testing/v3/ct"
	_ "github.com/yannh/kubeconform/cmd/kubeconform"
	_ "github.com/zegl/kube-score/cmd/kube-score"
)
